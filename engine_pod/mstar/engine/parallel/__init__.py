"""Tensor-parallel ranks: their process groups and processes (`group`), the per-step message
rank 0 sends the others (`channel`), and a worker rank's loop (`worker`). The model side (the
sharded layers) is `mstar.engine.model.tp`; the executor rank 0's engine steps through is
`mstar.engine.executor`."""
