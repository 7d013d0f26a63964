"""What ``mbx plan`` prints, outside the command line that parses its options: the plan's text and JSON
(:mod:`.plan`) and its figure (:mod:`.plan_plot`).

Importing it imports neither torch nor Bridge (matplotlib only when a figure is drawn). Its figures are in
:mod:`megatron_bridge_ext.sizes`'s units and its tables :mod:`megatron_bridge_ext.table`'s, as ``mbx diagnose``'s
(:mod:`megatron_bridge_ext.diagnose.report`, :mod:`megatron_bridge_ext.diagnose.compare`) are.
"""
