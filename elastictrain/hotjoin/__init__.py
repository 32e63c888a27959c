"""Hot join: a warm worker factory (zygote) per host and its client."""
