"""Differential fuzzing of the pass: a seeded generator of graphs around the pattern
(:mod:`.generator`), an oracle that compiles each with and without the pass
(:mod:`.oracle`), pairs of gloo ranks that run them (:mod:`.pair`) and the report
(:mod:`.report`).  The command is ``tests/fuzzing/fuzz_pass.py``."""
