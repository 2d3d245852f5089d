"""In-rank runtime: the wrapper, the process group per generation, progress and state transfer."""
