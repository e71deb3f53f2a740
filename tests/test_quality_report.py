"""bench/quality/quality_report's LoRA-against-full table and plot, on hand-made links.json records."""

from bench.quality.quality_report import finetune_plot, finetune_table


def _rec(mode: str, lr: float, seed: int, em: float, loss: float) -> dict:
    return {
        "task": "word",
        "finetune": mode,
        "lr": lr,
        "codec": "lowrank",
        "steps": 100,
        "seed": seed,
        "em_dense_eval": em,
        "eval_loss": loss,
        "trained_params": 4_884_480 if mode == "lora" else 134_515_008,
        "step_time_s": 3.0,
        "eval_loss_curve": [[10, 2 * loss], [100, loss]],
    }


def test_seeds_of_one_configuration_share_a_row_and_learning_rates_do_not(tmp_path):
    runs = [
        _rec("full", 1e-4, 1, 0.50, 0.30),
        _rec("full", 1e-4, 0, 0.70, 0.10),
        _rec("lora", 1e-3, 0, 0.60, 0.20),
        _rec("lora", 2e-3, 0, 0.40, 0.40),
    ]
    rows = [line for line in finetune_table(runs).splitlines() if line.startswith("| word")]
    assert len(rows) == 3
    full = next(r for r in rows if "| full |" in r)
    # seeds in order, each seed's EM, and their mean
    assert "| 0,1 |" in full and "0.700 / 0.500" in full and "| 0.600 |" in full and "| 0.200 |" in full
    assert "134.52 M" in full and any("4.88 M" in r and "| 0.002 |" in r for r in rows)
    assert finetune_plot(runs, tmp_path).stat().st_size > 1000
