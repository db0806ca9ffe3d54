"""TF1's strategy API: ``compat.v1``'s strategies and ``contrib.distribute``'s towers.

They sit on top of the TF2 strategies (``_strategies``, ``_distributed``) and add only
the TF1 surface (sessions' config, ``make_dataset_iterator``, tower contexts).
"""
