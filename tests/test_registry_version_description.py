"""The compression table of a registered version's description, as MLflow's version page shows it:
a fixed-width code block whose columns line up, the rejected artifacts' reasons below it.
tests/test_e2e_ui_mlflow.py checks the columns' spacing on the page itself, in Chromium."""

from __future__ import annotations

import re

from hetflow.records import ExportRecord

EXPORTED = {
    "float_test_accuracy": 0.9359,
    "chosen_tflite": "tflite_pruned_int8",
    "artifacts": {
        "saved_model": {
            "format": "saved_model",
            "path": "/runs/a/saved_model",
            "bytes": 98604,
            "gzip_bytes": 46336,
            "test_accuracy": 0.93593,
            "agreement_with_float": 1.0,
            "max_logit_difference": 1e-6,
            "latency_ms": 0.57911,
            "accuracy_drop": -0.00003,
            "accepted": True,
        },
        "tflite_pruned_int8": {
            "format": "tflite",
            "path": "/runs/a/compressed/pruned_int8.tflite",
            "bytes": 14220,
            "gzip_bytes": 7101,
            "test_accuracy": 0.9331,
            "agreement_with_float": 0.98999,
            "max_logit_difference": 2.1,
            "latency_ms": 0.00412,
            "sparsity": 0.5012,
            "encoding": "sparse",
            "accuracy_drop": 0.0028,
            "accepted": True,
        },
        "tflite_float16": {
            "format": "tflite",
            "path": "/runs/a/compressed/float16.tflite",
            "bytes": 21344,
            "gzip_bytes": 19020,
            "test_accuracy": 0.9359,
            "agreement_with_float": 1.0,
            "max_logit_difference": 0.01,
            "latency_ms": 0.0061,
            "sparsity": 0.0,
            "encoding": "dense",
            "accuracy_drop": 0.0,
            "accepted": True,
        },
        "tflite_int8": {
            "format": "tflite",
            "path": "/runs/a/compressed/int8.tflite",
            "bytes": 12000,
            "gzip_bytes": 9101,
            "test_accuracy": 0.8,
            "agreement_with_float": 0.81,
            "max_logit_difference": 6.3,
            "latency_ms": 0.0041,
            "sparsity": 0.0,
            "encoding": "dense",
            "accuracy_drop": 0.1359,
            "accepted": False,
            "reason": "accuracy drop 0.1359 > max_accuracy_drop 0.01",
        },
    },
}


def test_the_compression_table_is_a_code_block_of_aligned_columns_with_every_value():
    from hetflow.tasks.register import compression_table

    assert compression_table(ExportRecord.model_validate(EXPORTED)) == (
        "```\n"
        "artifact            bytes  gzipped      test  agreement  latency  sparsity  weight    verdict\n"
        "                             bytes  accuracy   w/ float       ms            encoding\n"
        "saved_model         98604    46336    0.9359     1.0000   0.5791    0.0000  dense     accepted\n"
        "tflite_pruned_int8  14220     7101    0.9331     0.9900   0.0041    0.5012  sparse    chosen\n"
        "tflite_float16      21344    19020    0.9359     1.0000   0.0061    0.0000  dense     accepted\n"
        "tflite_int8         12000     9101    0.8000     0.8100   0.0041    0.0000  dense     rejected\n"
        "```\n"
        "\n"
        "Latency: milliseconds per example at batch 1. chosen: the smallest accepted TFLite file, the one "
        "registered as this run's version of the -tflite model.\n"
        "\n"
        "- `tflite_int8` rejected: accuracy drop 0.1359 > max_accuracy_drop 0.01"
    )


def test_a_long_rejection_reason_goes_below_the_table_and_does_not_widen_it():
    from hetflow.tasks.register import compression_table

    reason = "served predictions disagree with the float model's on 31 of 256 test images " * 5
    exported = {**EXPORTED, "artifacts": {**EXPORTED["artifacts"]}}
    exported["artifacts"]["tflite_int8"] = {**exported["artifacts"]["tflite_int8"], "reason": reason}
    block, _, notes = compression_table(ExportRecord.model_validate(exported)).split("\n\n")
    lines = block.splitlines()[1:-1]  # within the fences
    assert max(map(len, lines)) == 94  # within the 95 characters MLflow's page shows without scrolling
    assert notes == f"- `tflite_int8` rejected: {reason}"
    # Every number column: right-aligned under its header, at least 2 spaces from the next column.
    header = lines[0]
    for title in ("bytes", "gzipped", "test", "agreement", "latency", "sparsity"):
        end = header.index(title) + len(title)
        for row in lines[2:]:
            assert re.fullmatch(r"\S", row[end - 1]) and row[end : end + 2] == "  ", (title, row)
