"""What evaluations and calibrations both run on a model, below both (``kvkit.evals`` and ``kvkit.calibrate``
import it; it imports neither): prompts (:mod:`.prompts`), a greedy generation under a policy's cache
(:mod:`.generation`), peer caches (:mod:`.peers`) and one exact prefill replayed into many policies' caches
(:mod:`.shared_prefill`)."""
