"""Nothing in this package is in a paper: it keeps the run's promises — the checks before any
work, the run folder, the feature cache, the devices and ranks it runs on.

errors       RunError, the one exception for a fault the user can fix
run          Settings, the run's identity, the checks before any work, and guard(), the one guard
             that turns any exception at a boundary (a file, a folder, a model) into its one line
folder       the run folder: never replaced; the files a run writes there; its log.txt, --quiet, and
             the progress lines of long loops (stderr, rate, ETA)
storage      atomic, checksummed files; locks; free space; fingerprints of weights and code
cache        the feature cache, keyed by the encoder's part of the identity
shards       sharded, memory-mapped features when a set is large
distributed  torchrun: sharded extraction, data-parallel training
"""
