"""``tandem profile``: measuring an engine's step times and acceptance into a speculation profile
(Tandem's engine: profiler.py; vLLM's: vllm_profile.py), on the calibration or edit prompts."""
