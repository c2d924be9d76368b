"""The generic sample store (torch-free): raw logs prepared once into fixed-width column files.

`layout` names the files of a store, `manifest` is its typed record (written last), `shuffle` the index
bijection that orders an epoch without per-row state, `reader` serves any rows by positioned reads, and `prepare`
turns a job's input files into shards with that job's parser (`shard_writer` writes one shard and
publishes it whole); `store_files` holds the store to the run dir's trust rule (no link followed, no FIFO
read, nothing removed that a prepare did not write). What a line means belongs to the job
(`jobs.rec.criteo`); everything else here serves any job.
"""
