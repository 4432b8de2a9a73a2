"""Nothing in this package is in a paper: it keeps the run's promises — the checks before any
work, the files it writes, the feature cache, the devices and ranks it runs on.

errors       RunError, the one exception for a fault the user can fix
checks       what is refused before any work
storage      atomic, checksummed files; locks; free space
outfolder    the results folder: written into .<name>.partial, moved into --out when finished
cache        the feature cache (and the Shapes world's)
shards       sharded, memory-mapped features when a set is large
fingerprints what an encoder's weights are, for the cache key
loader       batches from the cache, read ahead
distributed  torchrun: sharded extraction, data-parallel training
budget       how long a method trains on a CPU, on how many threads
model_files  real encoders' files on disk: paths, preprocessing, what to download
"""
