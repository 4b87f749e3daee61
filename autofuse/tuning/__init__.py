"""The tuning side: which groups to try (`partition`), which candidate gets the next trial (`scheduler`), one trial
end to end (`trial`), the cover (`select`) and its check against jax.jit (`validate`), over one ledger of trials
(`ledger`); `local` and `workers` are the two drivers, `job` what both set up first, `report` what a job found.

(Named `tuning`, not `tune`: `autofuse.tune` is the public function, and importing a subpackage of that name
would rebind it.)
"""
