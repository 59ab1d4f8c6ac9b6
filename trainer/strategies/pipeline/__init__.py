"""Pipeline parallelism: the strategy and how a module is split into stages."""
