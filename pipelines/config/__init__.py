"""The typed, validated configuration of one RL pipeline (the job config nests it).

    pipeline.py      PipelineConfig: the top-level keys, the checks across sections, `settings`
    sections.py      how a section is declared: a settings dataclass, its YAML model built from it
    preflight.py     what needs the disk (model dir, tokenizer, every dataset row), before Ray starts
    model_dir.py     the model directory and its tokenizer
    deprecations.py  renamed keys: still read for one release, with a one-line notice
"""

from trajflow.deprecations import TrajflowDeprecation
from trajflow.operators.contracts.stage import ResourceConfig
from trajflow.operators.trainer.plan import TrainerConfig
from trajflow.pipelines.config.deprecations import migrate_deprecated_keys
from trajflow.pipelines.config.model_dir import check_model_dir, checked_tokenizer
from trajflow.pipelines.config.pipeline import MAX_STEPS, SECTIONS, PipelineConfig, RunSettings, check_task
from trajflow.pipelines.config.preflight import preflight

__all__ = ["MAX_STEPS", "SECTIONS", "PipelineConfig", "ResourceConfig", "RunSettings", "TrainerConfig",
           "TrajflowDeprecation", "check_model_dir", "check_task", "checked_tokenizer", "migrate_deprecated_keys",
           "preflight"]
