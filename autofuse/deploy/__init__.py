"""Deploy time: what a traced signature of `autofuse.jit` runs. `background` starts a background tuning job as a
process, never importing the tuner (its process entry is `autofuse.tuning.background_entry`)."""
