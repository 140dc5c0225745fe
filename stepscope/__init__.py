"""stepscope: why GPU training is slow, and where.

Installed as one namespace so no generic module name (`exporter`, `hooks`) collides with another
distribution or a user's own files: `stepscope.hooks` (instrument a training loop), `stepscope.exporter`
(the node daemon, with the `exporter` extra), `stepscope.report` (the run report) and
`stepscope.contract` (metric names and thresholds every part shares).
"""
