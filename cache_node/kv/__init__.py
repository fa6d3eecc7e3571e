"""The parts of the KV-cache manager (cache_node/kv_manager.py is its public face).

sequence.py   Sequence and the value types the manager's API returns
prefix.py     block keys, finding a prompt's cached prefix, publishing full blocks
tiers.py      device allocation, the host tier, promotion, swapping, dropping on close
decode.py     batched decode steps and the decode group
budget.py     what a token budget drops
events.py     the STORED / REMOVED event queue
integrity.py  the invariants check_integrity() verifies
compiled.py   open, reserve and free in C for a manager without prefix caching
"""
