"""The typed, validated configuration of one RL pipeline (the job config nests it).

    pipeline.py      PipelineConfig: the top-level keys and the checks across sections
    sections.py      how a section is declared (strict pydantic, or built from a settings dataclass)
    model_dir.py     the model directory and its tokenizer, checked before Ray starts
    deprecations.py  renamed keys: still read for one release, with a one-line notice
"""

from trajflow.pipelines.config.deprecations import TrajflowDeprecation, migrate_deprecated_keys
from trajflow.pipelines.config.model_dir import check_model_dir, checked_tokenizer
from trajflow.pipelines.config.pipeline import MAX_STEPS, PipelineConfig, check_task
from trajflow.pipelines.config.sections import ResourceConfig, TrainerConfig

__all__ = ["MAX_STEPS", "PipelineConfig", "ResourceConfig", "TrainerConfig", "TrajflowDeprecation",
           "check_model_dir", "check_task", "checked_tokenizer", "migrate_deprecated_keys"]
