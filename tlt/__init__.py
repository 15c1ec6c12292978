"""tlt: reasoning RL with adaptive speculative decoding."""
