"""Per-model calibration of policies (``kvkit calibrate <policy>``).

* ``kvkit calibrate duo``: a DuoAttention head pattern (:mod:`kvkit.calibrate.duo`).
* ``kvkit calibrate shadowkv | tidal | zipcache``: one per-model knob each (:mod:`kvkit.calibrate.knobs`),
  written as a section of the model's calibration file, which the policy finds from the model's config
  (:mod:`kvkit.calibrate.store`; shipped files in ``kvkit/data/calibration``).
"""
