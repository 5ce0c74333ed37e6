"""Expert-parallel dispatchers over ``torch.distributed``.

``groups`` (process groups, placement, agreement checks), ``base`` (``EPDispatcher``, packed rows),
``allgather``, ``all2all``, ``low_latency``.
"""
