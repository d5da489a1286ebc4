__version__ = "0.56.0"
