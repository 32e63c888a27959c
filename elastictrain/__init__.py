"""elastictrain: elastic, fault-tolerant PyTorch training on Horovod elastic."""

__version__ = "0.1.0"
