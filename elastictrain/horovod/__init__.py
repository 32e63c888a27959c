"""Every repair of Horovod 0.28.1: the C++ patch, the driver's repairs, private attributes."""
