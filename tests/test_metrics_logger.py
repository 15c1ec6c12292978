"""The console progress bar's figures (tlt.rl.logging.MetricsLogger)."""
from tlt.config import TrainerConfig
from tlt.rl.logging import MetricsLogger


def test_the_progress_bar_shows_a_dash_where_a_step_had_no_sd_step(tmp_path):
    """A step whose rollout ran no SD step has no accept length (nan): the bar shows "-", not "nan"; a step with
    one shows its figure."""
    logger = MetricsLogger(TrainerConfig(logger=["console"]), tmp_path, total_steps=2)
    logger.log(1, {"rollout/spec_accept_length": 1.5, "timing_s/step": 20.0})
    assert logger.shown["accept"] == "1.5"
    logger.log(2, {"rollout/spec_accept_length": float("nan"), "timing_s/step": 21.0})
    assert logger.shown == {"accept": "-", "step_s": "21"}
    logger.close()
