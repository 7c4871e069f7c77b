"""Tokenizer wrapper: a `tokenizers` BPE (tokenizer.json) or a sentencepiece model (tokenizer.model),
plus the chat template, bos/eos from tokenizer_config.json."""
import json
from pathlib import Path

import jinja2


class Tokenizer:
    def __init__(self, folder):
        folder = Path(folder)
        cfg_path = folder / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
        if (folder / "tokenizer.json").exists():
            from tokenizers import Tokenizer as HFTokenizer
            self.tok = HFTokenizer.from_file(str(folder / "tokenizer.json"))
            self.sp = None
            token_id = self.tok.token_to_id
        elif (folder / "tokenizer.model").exists():
            import sentencepiece
            self.sp = sentencepiece.SentencePieceProcessor(model_file=str(folder / "tokenizer.model"))
            self.tok = None
            token_id = lambda t: (i if (i := self.sp.piece_to_id(t)) != self.sp.unk_id() else None)
        else:
            raise ValueError(f"no tokenizer.json or tokenizer.model in {folder}: add the model's tokenizer file")
        self.bos_id = _id(cfg.get("bos_token"), token_id, self.sp.bos_id() if self.sp else None)
        self.eos_id = _id(cfg.get("eos_token"), token_id, self.sp.eos_id() if self.sp else None)
        self.add_bos = cfg.get("add_bos_token", self.sp is not None)
        self.chat_template = cfg.get("chat_template")
        if isinstance(self.chat_template, list):  # HF allows a list of named templates
            self.chat_template = next((t["template"] for t in self.chat_template if t.get("name") == "default"), None)
        self.special = {k: cfg[k] if isinstance(cfg[k], str) else cfg[k].get("content")
                        for k in ("bos_token", "eos_token") if cfg.get(k)}

    def encode(self, text: str, bos: bool = None) -> list:
        ids = self.sp.encode(text) if self.sp else self.tok.encode(text, add_special_tokens=False).ids
        if (self.add_bos if bos is None else bos) and self.bos_id is not None:
            ids = [self.bos_id] + ids
        return ids

    def decode(self, ids) -> str:
        return self.sp.decode(list(ids)) if self.sp else self.tok.decode(list(ids), skip_special_tokens=False)

    def chat(self, messages: list) -> str:
        """Renders a list of {"role", "content"} with the model's chat template, ready for the
        assistant's turn. A model without a template gets its raw user text."""
        if not self.chat_template:
            return "\n".join(m["content"] for m in messages)
        env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        return env.from_string(self.chat_template).render(messages=messages, add_generation_prompt=True, **self.special)


def _id(token, token_id, fallback):
    if isinstance(token, dict):
        token = token.get("content")
    if token is not None and token_id(token) is not None:
        return token_id(token)
    return fallback if fallback is None or fallback >= 0 else None


def _raise(msg):
    raise ValueError(f"chat template: {msg}")


def gguf_tokenizer(fields: dict):
    """Builds a byte-level BPE `tokenizers.Tokenizer` from GGUF metadata (tokenizer.ggml.model 'gpt2').
    Returns (tokenizer, tokenizer_config dict)."""
    from tokenizers import Tokenizer as HFTokenizer, AddedToken, Regex, decoders, models, pre_tokenizers

    model = fields.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise ValueError(f"GGUF tokenizer '{model}' is not supported (only byte-level BPE, 'gpt2'): "
                         "use the model's Hugging Face folder instead")
    tokens = fields["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ", 1)) for m in fields["tokenizer.ggml.merges"]]
    tok = HFTokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges, fuse_unk=False))
    pre = fields.get("tokenizer.ggml.pre", "default")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":  # single digits split first, then the GPT-2 regex
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    elif pre in ("default", "gpt2"):
        tok.pre_tokenizer = byte_level
    else:
        raise ValueError(f"GGUF pre-tokenizer '{pre}' is not supported: use the model's Hugging Face folder instead")
    tok.decoder = decoders.ByteLevel()
    types = fields.get("tokenizer.ggml.token_type", [1] * len(tokens))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty == 3])
    bos, eos = fields.get("tokenizer.ggml.bos_token_id"), fields.get("tokenizer.ggml.eos_token_id")
    cfg = {
        "bos_token": tokens[bos] if bos is not None else None,
        "eos_token": tokens[eos] if eos is not None else None,
        "add_bos_token": bool(fields.get("tokenizer.ggml.add_bos_token", False)),
        "chat_template": fields.get("tokenizer.chat_template"),
    }
    return tok, cfg
