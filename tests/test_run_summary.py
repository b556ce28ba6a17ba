"""The summary a PPO run logs at its end (`rl2.metrics.run_summary`) says what happened: step times over the
steps that updated the policy, and that none did when none did (not a mean step time of 0 s)."""

from rl2.metrics import run_summary

UPDATED = {"reward/mean": 0.5, "env_errors": 0.0, "time/rollout": 0.2, "time/reward": 0.1, "time/logps": 0.1,
           "time/update": 0.5, "time/sync": 0.1, "time/step": 1.0}
NOT_UPDATED = {"reward/mean": 0.0, "env_errors": 0.0, "time/rollout": 0.3, "time/reward": 0.1}


def test_a_run_in_which_no_step_updated_says_so():
    summary = run_summary([{"step": 1, **NOT_UPDATED}, {"step": 2, **NOT_UPDATED}])
    assert "mean step time" not in summary and "0.000s" not in summary
    assert "no step updated the policy (none of the 2 steps" in summary


def test_step_times_are_over_the_steps_that_updated():
    summary = run_summary([{"step": 0, "test/reward_mean": 0.0}, {"step": 1, **UPDATED}, {"step": 2, **NOT_UPDATED}])
    assert ("mean step time 1.000s (of the 1 of 2 steps that updated): rollout 0.200s (20%)"
            in summary)
    summary = run_summary([{"step": 1, **UPDATED}, {"step": 2, **UPDATED}])
    assert "mean step time 1.000s: rollout 0.200s (20%), reward 0.100s (10%), logps 0.100s (10%), update 0.500s " \
           "(50%), sync 0.100s (10%)" in summary


def test_recycled_env_workers_are_not_reported_as_faults():
    """Workers replaced after rollout.env_worker_max_calls are planned: said apart from the faults recovered."""
    from rl2.metrics import env_error_summary

    rows = [{"step": 1, "env_errors": 0.0, "faults/env_worker_recycles": 2.0, "faults/env_worker_restarts": 1.0},
            {"step": 2, "env_errors": 0.0, "faults/env_worker_recycles": 1.0}]
    line = env_error_summary(rows)
    assert "recovered faults: env_worker_restarts 1;" in line and "recycles" not in line
    assert line.endswith("env workers recycled 3 times (rollout.env_worker_max_calls)")
    assert "recovered faults" not in env_error_summary([{"step": 1, "env_errors": 0.0, "faults/env_worker_recycles": 4.0}])
