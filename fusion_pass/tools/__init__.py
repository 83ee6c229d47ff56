"""The tools around the pass, apart from it: the ``fusion-pass`` command (:mod:`.cli`)
and what it runs: the demo (real vLLM at TP=2, :mod:`.demo`), the reading of graph
dumps and decision records (:mod:`.inspect_dumps`) and the gate's table
(:mod:`.gate_table`).  The pass imports none of them."""
