"""What the commands print from their results, outside the command line so that every command that shows a
result shows it one way: ``mbx plan``'s text and JSON (:mod:`.plan`) and its figure (:mod:`.plan_plot`).

Importing it imports neither torch nor Bridge (matplotlib only when a figure is drawn). The units of every
figure are :mod:`megatron_bridge_ext.sizes`'s, the tables :mod:`megatron_bridge_ext.table`'s.
"""
