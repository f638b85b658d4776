"""CleanRLHF core: the thin plumbing that the algorithm scripts in `algos/` call explicitly.

Modules are imported by name (`from core import data`, `data.load_sft_examples(...)`) so a reader always sees
where a piece lives. Nothing here runs at import time.
"""
