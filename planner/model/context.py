"""How long a sequence a model was trained for, and what training beyond it asks of the user.

A model's native context is its config's max_position_embeddings (ModelSpec.max_seq_len):
the positions its weights have seen, already stretched by the config's rope_scaling where it
has one (Llama 3.1's "llama3" factor 8 over 8,192 positions reaches 131,072). A longer
--seq-len plans fine arithmetically, but trains on positions the model never saw: the
attention scores of RoPE models degrade past them (Chen et al. 2023, "Extending Context Window
of Large Language Models via Positional Interpolation"; Peng et al. 2023, YaRN), a learned
position table has no row for them, and ALiBi's biases extrapolate only in part (Press et
al. 2022). So `plan` refuses it unless the user says the positions are extended
(`--allow-long-context`), and says how they could be.
"""

from __future__ import annotations

from planner.model.spec import ModelSpec
from topologies.errors import UsageError


def rope_scaling_words(model: ModelSpec) -> str:
    """'its rope scaling (llama3, factor 8 over 8192 original positions)', or what it lacks."""
    if model.position != "rope":
        return f"{model.position} positions"
    scaling = model.rope_scaling
    if scaling is None:
        return "no rope_scaling in its config"
    factor = f", factor {scaling.factor:g}" if scaling.factor != 1.0 else ""
    original = f" over {scaling.original_max_position} original positions" if scaling.original_max_position else ""
    return f"its rope scaling ({scaling.kind}{factor}{original})"


def _how_to_extend(model: ModelSpec) -> str:
    if model.position == "learned":
        return ("its learned position table has no row past it: extend the table (and train it) yourself")
    if model.position == "alibi":
        return "ALiBi biases extend to any length, but quality past the trained length is not assured"
    if model.rope_scaling is not None:
        return ("raise rope_scaling's factor in config.json (and pass that --model) to stretch the positions "
                "further")
    return ("extend its positions first: add rope_scaling to config.json (YaRN, Llama 3's, linear position "
            "interpolation) or raise rope_theta, and pass that --model")


def check_context(model: ModelSpec, seq_len: int, allow_long_context: bool, flag: str = "--seq-len") -> None:
    """A UsageError when `seq_len` exceeds the model's native context and the user has not allowed it."""
    if seq_len <= model.max_seq_len or allow_long_context:
        return
    raise UsageError(
        f"{flag} {seq_len} is beyond {model.name}'s native context of {model.max_seq_len} tokens "
        f"(max_position_embeddings; {rope_scaling_words(model)}): positions past {model.max_seq_len} were never "
        f"trained. {_how_to_extend(model)[0].upper()}{_how_to_extend(model)[1:]}, then pass --allow-long-context; "
        f"or use {flag} {model.max_seq_len} or less")


def long_context_sentence(model: ModelSpec, seq_len: int) -> str | None:
    """The explanation's reminder when a plan runs past the native context (--allow-long-context)."""
    if seq_len <= model.max_seq_len:
        return None
    return (f"Sequences of {seq_len} tokens run past {model.name}'s native context of {model.max_seq_len} "
            f"(--allow-long-context; {rope_scaling_words(model)}): the positions beyond it need the extension "
            "you configured.")
