"""nonstop's benchmarks and soaks, beside the package: nonstop against its peers (torchrun,
torchft) in the same run on the same job, test hosts (network namespaces on one machine), the
control plane simulated at scale. ``nonstop bench`` and ``nonstop chaos`` run them where this
distribution is installed (``make`` does, from a checkout: ``pip install -e bench``)."""
