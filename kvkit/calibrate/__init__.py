"""Per-model calibration of policies (``kvkit calibrate <policy>``).

* ``kvkit calibrate duo``: a DuoAttention head pattern (:mod:`kvkit.calibrate.duo`).
* ``kvkit calibrate <policy>`` (shadowkv, tidal, zipcache, cake, snapkv, chelsea): one module per calibrated policy,
  ``kvkit/calibrate/<policy>.py``, registered with :mod:`kvkit.calibrate.registry` (what they share:
  :mod:`kvkit.calibrate.search`, :mod:`kvkit.calibrate.needles`); each writes one section of the model's calibration
  file, which the policy finds from the model's config (:mod:`kvkit.calibration`; shipped files in
  ``kvkit/data/calibration``).
"""
