"""Studies built on ``difftx compare``: each runs one or more comparisons and reads their results.
``tune`` (each arm at its own value of a field), ``sweep`` (the paired gap over a learning-rate grid),
``scale`` and ``scale_recall`` (the gap over model sizes), ``map`` (the regime map: a grid of comparisons).
They import :mod:`difftx.compare`; compare imports none of them (a study hands its own report section to
:func:`difftx.compare.report.write_outputs`)."""
