"""``mbx plan --search``: every legal layout of a fixed workload on N GPUs, its peak by phase and its step time; the
fastest that fits and the front of peak memory against step time (:mod:`.candidates`, :mod:`.walk`, :mod:`.front`).
The plain ``mbx plan``'s answer walks the same way the levers reachable from the layout as given (:mod:`.reachable`),
by one rule (:mod:`.rule`)."""
