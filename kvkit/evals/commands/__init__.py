"""The ``kvkit eval ...`` and ``kvkit bench`` commands, one module per command family; their arguments are defined in
:mod:`kvkit.evals.cli`, which imports a command's module only when that command runs.

- :mod:`~kvkit.evals.commands.ruler`: ``eval ruler`` and ``eval sweep`` (RULER prompts through several policies);
- :mod:`~kvkit.evals.commands.niah`: ``eval niah`` (depth x length grid and heatmap);
- :mod:`~kvkit.evals.commands.needles`: ``eval needles`` (fresh needles, policies and peers);
- :mod:`~kvkit.evals.commands.longbench`: ``eval longbench``; :mod:`~kvkit.evals.commands.compare`: ``eval compare``;
- :mod:`~kvkit.evals.commands.bench`: ``kvkit bench`` (bundled model; ``--shape``: :mod:`kvkit.evals.gpu`);
- shared by them: :mod:`~kvkit.evals.commands.runs` (a run's policy, model, config, seed, summary, ``--run`` specs)
  and :mod:`~kvkit.evals.commands.prompts` (``--prompts`` files read and checked).
"""
