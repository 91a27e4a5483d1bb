"""``autopar tune``: measure the best candidates on this machine, refit its prices, keep the plan that ran fastest.

The package, one job a module: :mod:`.search` the steps in order (solve, pick, measure, refit, solve
again, keep the fastest), :mod:`.candidates` which plans, :mod:`.ranks` what every rank runs,
:mod:`.launch` the spawned ranks and what happens when a candidate takes them down, :mod:`.group`
the same under an outside ``torchrun``, :mod:`.refit` the fit, :mod:`.memory` a CPU rank's peak
tensor bytes, :mod:`.metrics_file` the refit from a training run's metrics file, and
:mod:`.command` the CLI's side. Kept free of imports, so the CLI's parser loads in no time.
"""
