"""The checks of a pipeline config that read the disk, run once before Ray starts.

    preflight(config) -> config

the model directory (config.json, a tokenizer, a causal-LM architecture, weights) and its
tokenizer loaded; the workload's names resolved (reward function and its signature, environment,
the dataset's columns); every row of a dataset read, checked and tokenized (kept in this process
for the run's prompt source); an lm_head adapter refused on a model whose output layer is its
input embedding; the top-k within the vocabulary and a teacher's directory and vocabulary the
model's; and `data.epochs` turned into `steps` when steps is not given (the returned
config). Each failure is one ValueError naming the key, as validation's are: the job prints it
as `trajflow: config error: ...` and exits 2. Validation itself (pipeline.py) reads no file.
"""

from __future__ import annotations

from typing import TypeVar

from trajflow.pipelines.config.model_dir import check_model_dir, checked_tokenizer, model_vocab_size, ties_embeddings
from trajflow.pipelines.config.pipeline import PipelineConfig

Config = TypeVar("Config", bound=PipelineConfig)


def _prepared_model(config: Config) -> Config:
    """A `model:` naming a model trajflow prepares from a package's files (engines/prepared.py):
    built into the cache on first use, and the config holds its directory from then on."""
    if config.model is None or config.model.exists():
        return config
    from trajflow.engines.prepared import find_prepared, prepare

    if find_prepared(str(config.model)) is None:
        return config
    try:
        path = prepare(str(config.model))
    except ValueError as e:  # a missing extra, a changed source file: one line
        raise ValueError(f"model: {e}") from None
    return config.model_copy(update={"model": path})


def _check_distributions(config: PipelineConfig) -> None:
    """`top_k_logprobs` within the model's vocabulary; a teacher a model directory whose ids are
    the student's (it scores the student's tokens)."""
    vocab = model_vocab_size(config.model_path)
    if config.top_k_logprobs and vocab is not None and config.top_k_logprobs > vocab:
        raise ValueError(f"top_k_logprobs: {config.top_k_logprobs} is more than the model's vocabulary of {vocab} ids")
    if config.teacher is None:
        return
    try:
        check_model_dir(config.teacher)
    except ValueError as e:
        raise ValueError(f"teacher: {e}") from None
    if model_vocab_size(config.teacher) != vocab:
        raise ValueError(f"teacher: {config.teacher} has {model_vocab_size(config.teacher)} ids, the model {vocab}: "
                         "the teacher scores the student's token ids")


def preflight(config: Config) -> Config:
    """`config` checked against the disk (see the module docstring); the same config, or a copy
    with `steps` derived from `data.epochs` and a named prepared model built into its cache."""
    config = _prepared_model(config)
    if config.model is not None:
        try:
            check_model_dir(config.model)
        except ValueError as e:
            raise ValueError(f"model: {e}") from None
    lora = config.lora
    if lora.r > 0 and "lm_head" in lora.target_modules and ties_embeddings(config.model_path):
        raise ValueError("lora.target_modules: lm_head on a model whose output layer is its input embedding "
                         "(tie_word_embeddings): the readers' merged weights would not be the trained model; "
                         "leave lm_head out")
    _check_distributions(config)
    workload = config.workload()
    workload.check()
    if config.data is not None and config.eval_every and not config.data.test_files:
        raise ValueError("eval_every: held-out evaluation of a dataset needs data.test_files (or eval_every: 0)")
    if config.model is None and config.data is None:
        return config  # the built-in warm start: its tokenizer loads in the processes that use it
    try:  # a tokenizer that does not load ends here, not in a Ray worker
        tokenizer = checked_tokenizer(config.model_path)
    except ValueError as e:
        raise ValueError(f"model: {e}") from None
    data = config.settings.data
    if data is None:
        return config
    from trajflow.tasks.dataset import checked_dataset

    # every row of every file, read and tokenized once (kept for the run's prompt source)
    required = workload.required_columns()  # the reward's; any other column may be null
    train = checked_dataset(data, workload.train_files(), tokenizer, required=required)
    if data.test_files:
        checked_dataset(data, workload.test_files(), tokenizer, key="data.test_files", required=required)
    if data.epochs is None:
        return config
    epoch = train.epoch_size
    available = data.epochs * epoch // config.prompts_per_step
    if available < 1:
        raise ValueError(f"data.epochs: {data.epochs} epoch(s) of {epoch} prompts are fewer than one step of "
                         f"{config.prompts_per_step}")
    if "steps" not in config.model_fields_set:
        return config.model_copy(update={"steps": available})  # the run's length, derived
    if config.steps > available:
        raise ValueError(f"steps: {config.steps} steps of {config.prompts_per_step} prompts need more than "
                         f"data.epochs={data.epochs} epochs of {epoch} prompts ({available} steps)")
    return config
