#!/usr/bin/env python3
"""Write a Hugging Face reference dump for `gemstage parity`.

Runs a Gemma 4 checkpoint with transformers (float32 by default) on given token ids, and
optionally one image, and writes DIR/manifest.json plus one .npy per tap, in the layout of
tests/fixtures/gemma4-tiny/* (the layout `gemstage parity --reference DIR` reads):

    python3 scripts/hf_dump.py --model /path/to/gemma-4-E2B-it --ids prompt.npy \
        [--image photo.jpg --expand-image-token] [--decode 32] [--dtype float32] --out ref/
    build/gemstage parity --model /path/to/gemma-4-E2B-it --reference ref/ --plot ref.svg

Taps are captured with forward hooks on the HF modules (names as in transformers'
models/gemma4/modeling_gemma4.py):
  language_model.embed_tokens            input -> llm_input_ids, output -> embeds_scaled
  language_model.embed_tokens_per_layer  input -> ple_ids, output reshaped -> ple_token_embeds
  language_model.per_layer_model_projection  input -> inputs_embeds (after the soft-token splice)
  language_model.project_per_layer_inputs    return value -> per_layer_inputs
  layers[l].pre_feedforward_layernorm    input -> hidden_after_attn[l]
  layers[l].per_layer_input_gate         input -> hidden_after_mlp[l]
  layers[l]                              output -> hidden_states[l]
  language_model.norm                    output -> final_hidden
  vision_tower.patch_embedder / .encoder / vision_tower / embed_vision
                                         -> vision_patch_embeds / vision_encoder_out /
                                            vision_pooled / vision_embedder_out
Only the prefill pass is recorded; decoding is greedy (first index on ties) with the KV cache and
no stop token, so decode_logits row i is the distribution decode_ids[i] was taken from.

`--print-layout` prints the file list below as JSON without importing torch or numpy; the test
suite checks it against the fixtures, so this list is the output-format contract.
"""

import argparse
import json
import os
import sys

# The output-format contract: every file this script writes, with its shape in symbols.
#   S prompt tokens, T = S + N, N decode steps, L layers, P PLE dim, D hidden, V vocab,
#   Np max patches, Pd = 3 * patch^2, Hv vision hidden, Ns soft tokens, H x W image size.
# "when": always | image (written only for image prompts) | ple (only for PLE checkpoints).
LAYOUT = [
    {"name": "input_ids.npy", "shape": ["S"], "dtype": "int64", "when": "always",
     "meaning": "prompt token ids (batch of one)"},
    {"name": "llm_input_ids.npy", "shape": ["S"], "dtype": "int64", "when": "always",
     "meaning": "ids of the main embedding lookup: placeholders replaced by pad_token_id"},
    {"name": "ple_ids.npy", "shape": ["S"], "dtype": "int64", "when": "ple",
     "meaning": "ids fed to embed_tokens_per_layer"},
    {"name": "embeds_scaled.npy", "shape": ["S", "D"], "dtype": "float32", "when": "always",
     "meaning": "embed_tokens(llm_input_ids) * embed_scale, before the soft-token splice"},
    {"name": "inputs_embeds.npy", "shape": ["S", "D"], "dtype": "float32", "when": "always",
     "meaning": "embeds_scaled with the vision soft tokens scattered into the placeholder rows"},
    {"name": "ple_token_embeds.npy", "shape": ["S", "L", "P"], "dtype": "float32", "when": "ple",
     "meaning": "get_per_layer_inputs: embed_tokens_per_layer(ple_ids) reshaped [S, L, P]"},
    {"name": "per_layer_inputs.npy", "shape": ["S", "L", "P"], "dtype": "float32", "when": "ple",
     "meaning": "project_per_layer_inputs output; layer l gets [:, l, :]"},
    {"name": "hidden_after_attn.npy", "shape": ["L", "S", "D"], "dtype": "float32",
     "when": "always", "meaning": "residual stream after the attention block of layer l"},
    {"name": "hidden_after_mlp.npy", "shape": ["L", "S", "D"], "dtype": "float32", "when": "ple",
     "meaning": "residual stream after the MLP block of layer l, before the PLE block"},
    {"name": "hidden_states.npy", "shape": ["L", "S", "D"], "dtype": "float32", "when": "always",
     "meaning": "output of decoder layer l (after the PLE block and * layer_scalar)"},
    {"name": "final_hidden.npy", "shape": ["S", "D"], "dtype": "float32", "when": "always",
     "meaning": "language_model.norm(hidden_states[-1])"},
    {"name": "logits.npy", "shape": ["S", "V"], "dtype": "float32", "when": "always",
     "meaning": "soft-capped logits of every prompt row"},
    {"name": "decode_ids.npy", "shape": ["N"], "dtype": "int64", "when": "always",
     "meaning": "greedy continuation with the KV cache; EOS not treated as a stop token"},
    {"name": "decode_logits.npy", "shape": ["N", "V"], "dtype": "float32", "when": "always",
     "meaning": "row i = logits decode_ids[i] was taken from (row 0 == logits[-1])"},
    {"name": "sequence_ids.npy", "shape": ["T"], "dtype": "int64", "when": "always",
     "meaning": "input_ids followed by decode_ids"},
    {"name": "decode_top2_margin.npy", "shape": ["N"], "dtype": "float32", "when": "always",
     "meaning": "per step: top-1 minus top-2 logit"},
    {"name": "image.png", "shape": ["H", "W", 3], "dtype": "uint8 PNG (RGB8)", "when": "image",
     "meaning": "the input image as RGB, as the processor saw it"},
    {"name": "pixel_values.npy", "shape": [1, "Np", "Pd"], "dtype": "float32", "when": "image",
     "meaning": "image processor output [1, max_patches, 3*patch^2]"},
    {"name": "image_position_ids.npy", "shape": [1, "Np", 2], "dtype": "int64", "when": "image",
     "meaning": "[1, max_patches, 2] patch (x, y) coordinates, (-1, -1) for padding"},
    {"name": "vision_patch_embeds.npy", "shape": ["Np", "Hv"], "dtype": "float32",
     "when": "image", "meaning": "vision_tower.patch_embedder output; padding rows irrelevant"},
    {"name": "vision_encoder_out.npy", "shape": ["Np", "Hv"], "dtype": "float32",
     "when": "image", "meaning": "vision encoder last_hidden_state; only real patch rows matter"},
    {"name": "vision_pooled.npy", "shape": ["Ns", "Hv"], "dtype": "float32", "when": "image",
     "meaning": "vision_tower output: pooled, padding stripped (standardized if configured)"},
    {"name": "vision_embedder_out.npy", "shape": ["Ns", "D"], "dtype": "float32",
     "when": "image", "meaning": "embed_vision output: the soft tokens"},
]

# Relative tolerances written to the manifest: atol = RTOL[tap] * max|reference| of that tap
# (the fixtures' hand-set values are for a tiny model; a real checkpoint's scales differ).
RTOL = {
    "embeds_scaled": 1e-6, "ple_token_embeds": 1e-6, "inputs_embeds": 1e-5,
    "per_layer_inputs": 1e-4, "hidden_after_attn": 1e-3, "hidden_after_mlp": 1e-3,
    "hidden_states": 1e-3, "final_hidden": 1e-3, "logits": 1e-4, "decode_logits": 1e-4,
    "vision_patch_embeds": 1e-5, "vision_encoder_out": 1e-4, "vision_pooled": 1e-4,
    "vision_embedder_out": 1e-5,
}


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--print-layout", action="store_true",
                   help="print the declared output files as JSON and exit (no torch needed)")
    p.add_argument("--model", help="Hugging Face Gemma 4 checkpoint directory or hub id")
    p.add_argument("--ids", help=".npy of prompt token ids ([S] or [1, S])")
    p.add_argument("--ids-list", help="prompt token ids as a comma-separated list")
    p.add_argument("--image", help="image file (PNG/JPEG) for the prompt's image placeholders")
    p.add_argument("--expand-image-token", action="store_true",
                   help="replace each single image_token_id in the ids by as many copies as the "
                        "image has soft tokens (what the HF processor does to <|image|>)")
    p.add_argument("--decode", type=int, default=8, help="greedy decode steps (default 8)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="dtype the model runs in (float32 matches gemstage's compute)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--rtol", type=float, default=None,
                   help="one relative tolerance for every float tap (default: per-tap values)")
    p.add_argument("--out", help="output directory")
    a = p.parse_args(argv)
    if not a.print_layout:
        for need in ("model", "out"):
            if getattr(a, need) is None:
                p.error(f"--{need} is required")
        if (a.ids is None) == (a.ids_list is None):
            p.error("give exactly one of --ids or --ids-list")
    return a


def load_ids(a, np):
    if a.ids_list is not None:
        ids = [int(x) for x in a.ids_list.split(",") if x.strip()]
    else:
        arr = np.load(a.ids)
        if arr.ndim == 2 and arr.shape[0] == 1:
            arr = arr[0]
        if arr.ndim != 1:
            sys.exit(f"{a.ids}: expected token ids of shape [S] or [1, S], found {arr.shape}")
        ids = [int(x) for x in arr]
    if not ids:
        sys.exit("no token ids")
    return ids


def run(a):
    import numpy as np
    import torch
    from PIL import Image
    from transformers import AutoConfig, AutoModelForImageTextToText, AutoModelForCausalLM

    torch.set_grad_enabled(False)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[a.dtype]
    config = AutoConfig.from_pretrained(a.model)
    multimodal = hasattr(config, "text_config") and config.text_config is not None
    cls = AutoModelForImageTextToText if multimodal else AutoModelForCausalLM
    model = cls.from_pretrained(a.model, dtype=dtype).to(a.device).eval()
    base = model.model
    lm = base.language_model if multimodal else base
    tcfg = config.text_config if multimodal else config
    vision = getattr(base, "vision_tower", None) if multimodal else None
    embed_vision = getattr(base, "embed_vision", None) if multimodal else None
    has_ple = bool(getattr(tcfg, "hidden_size_per_layer_input", 0))
    L = tcfg.num_hidden_layers

    ids = load_ids(a, np)
    pixel_values = position_ids = None
    rgb = None
    if a.image:
        if vision is None:
            sys.exit(f"{a.model}: this checkpoint has no vision tower")
        from transformers import AutoImageProcessor
        proc = AutoImageProcessor.from_pretrained(a.model)
        rgb = Image.open(a.image)
        from PIL import ImageOps
        rgb = ImageOps.exif_transpose(rgb).convert("RGB")  # as transformers' load_image
        feats = proc(images=[rgb], return_tensors="pt")
        for k in ("pixel_values", "image_position_ids"):
            if k not in feats:
                sys.exit(f"the image processor returned {sorted(feats.keys())}, no {k}")
        pixel_values = feats["pixel_values"].to(a.device, dtype)
        position_ids = feats["image_position_ids"].to(a.device)
        k2 = config.vision_config.pooling_kernel_size ** 2
        n_soft = int((position_ids[0, :, 0] >= 0).sum().item()) // k2
        if a.expand_image_token:
            out = []
            for t in ids:
                out.extend([t] * n_soft if t == config.image_token_id else [t])
            ids = out
        n_ph = sum(1 for t in ids if t == config.image_token_id)
        if n_ph != n_soft:
            sys.exit(f"the prompt has {n_ph} image tokens but the image yields {n_soft} soft "
                     f"tokens (use --expand-image-token with one image token in the ids)")

    taps = {}
    handles = []

    def first(x):
        if isinstance(x, (tuple, list)):
            return x[0]
        if hasattr(x, "last_hidden_state"):
            return x.last_hidden_state
        return x

    def keep(name, t, layer=None):
        # A copy: HF updates some residual tensors in place after the hook has run.
        t = first(t).detach().float().cpu().numpy().copy()
        if layer is None:
            taps.setdefault(name, t)  # the first call of the prefill pass
        else:
            taps.setdefault(name, [None] * L)
            if taps[name][layer] is None:
                taps[name][layer] = t

    def pre(name, layer=None, ids=False):
        def hook(_m, args):
            if ids:
                taps.setdefault(name, args[0].detach().cpu().numpy().astype(np.int64))
            else:
                keep(name, args[0], layer)
        return hook

    def post(name, layer=None):
        def hook(_m, _args, out):
            keep(name, out, layer)
        return hook

    handles.append(lm.embed_tokens.register_forward_pre_hook(pre("llm_input_ids", ids=True)))
    handles.append(lm.embed_tokens.register_forward_hook(post("embeds_scaled")))
    if has_ple:
        handles.append(lm.embed_tokens_per_layer.register_forward_pre_hook(
            pre("ple_ids", ids=True)))
        handles.append(lm.embed_tokens_per_layer.register_forward_hook(post("ple_token_embeds")))
        handles.append(lm.per_layer_model_projection.register_forward_pre_hook(
            pre("inputs_embeds")))
        orig_project = lm.project_per_layer_inputs

        def project(*args, **kwargs):
            out = orig_project(*args, **kwargs)
            keep("per_layer_inputs", out)
            return out

        lm.project_per_layer_inputs = project
    for i, layer in enumerate(lm.layers[:L]):
        handles.append(layer.pre_feedforward_layernorm.register_forward_pre_hook(
            pre("hidden_after_attn", i)))
        if has_ple:
            handles.append(layer.per_layer_input_gate.register_forward_pre_hook(
                pre("hidden_after_mlp", i)))
        handles.append(layer.register_forward_hook(post("hidden_states", i)))
    handles.append(lm.norm.register_forward_hook(post("final_hidden")))
    if vision is not None and pixel_values is not None:
        handles.append(vision.patch_embedder.register_forward_hook(post("vision_patch_embeds")))
        handles.append(vision.encoder.register_forward_hook(post("vision_encoder_out")))
        handles.append(vision.register_forward_hook(post("vision_pooled")))
        handles.append(embed_vision.register_forward_hook(post("vision_embedder_out")))

    input_ids = torch.tensor([ids], dtype=torch.long, device=a.device)
    kwargs = {}
    if pixel_values is not None:
        kwargs = {"pixel_values": pixel_values, "image_position_ids": position_ids}
    out = model(input_ids=input_ids, use_cache=True, **kwargs)
    for h in handles:
        h.remove()
    if has_ple:
        lm.project_per_layer_inputs = orig_project
    logits = out.logits[0].float().cpu().numpy()

    # Greedy decode with the KV cache.
    past = out.past_key_values
    row = out.logits[0, -1].float()
    dec_ids, dec_logits, margins = [], [], []
    for step in range(a.decode):
        top2 = torch.topk(row, 2)
        best = int(torch.argmax(row).item())  # first index on ties
        dec_ids.append(best)
        dec_logits.append(row.cpu().numpy())
        margins.append(float(top2.values[0] - top2.values[1]))
        if step + 1 == a.decode:
            break
        o = model(input_ids=torch.tensor([[best]], device=a.device), past_key_values=past,
                  use_cache=True)
        past = o.past_key_values
        row = o.logits[0, -1].float()

    S = len(ids)
    arrays = {
        "input_ids": np.array(ids, dtype=np.int64),
        "logits": logits,
        "decode_ids": np.array(dec_ids, dtype=np.int64),
        "decode_logits": np.stack(dec_logits).astype(np.float32) if dec_logits else
        np.zeros((0, logits.shape[-1]), np.float32),
        "sequence_ids": np.array(ids + dec_ids, dtype=np.int64),
        "decode_top2_margin": np.array(margins, dtype=np.float32),
    }
    for name, t in taps.items():
        if isinstance(t, list):
            t = np.stack([x[0] if x.ndim == 3 else x for x in t])  # [L, S, D]
        elif t.ndim >= 2 and t.shape[0] == 1 and name not in ("vision_pooled", "vision_embedder_out"):
            t = t[0]
        arrays[name] = t
    if "ple_token_embeds" in arrays:
        arrays["ple_token_embeds"] = arrays["ple_token_embeds"].reshape(S, L, -1)
    if "inputs_embeds" not in arrays and "embeds_scaled" in arrays and pixel_values is None:
        arrays["inputs_embeds"] = arrays["embeds_scaled"]
    if "vision_pooled" in arrays and arrays["vision_pooled"].ndim == 3:
        arrays["vision_pooled"] = arrays["vision_pooled"].reshape(-1, arrays["vision_pooled"].shape[-1])
    if "vision_embedder_out" in arrays and arrays["vision_embedder_out"].ndim == 3:
        arrays["vision_embedder_out"] = arrays["vision_embedder_out"].reshape(
            -1, arrays["vision_embedder_out"].shape[-1])
    if pixel_values is not None:
        arrays["pixel_values"] = pixel_values.float().cpu().numpy()
        arrays["image_position_ids"] = position_ids.cpu().numpy().astype(np.int64)

    os.makedirs(a.out, exist_ok=True)
    files, tolerances = {}, {}
    meanings = {f["name"]: f["meaning"] for f in LAYOUT}
    for f in LAYOUT:
        stem = f["name"][:-4]
        if f["name"] == "image.png" and rgb is not None:
            rgb.save(os.path.join(a.out, "image.png"))
            files["image.png"] = {"shape": [rgb.height, rgb.width, 3], "dtype": f["dtype"],
                                  "meaning": f["meaning"]}
            continue
        if stem not in arrays:
            continue
        arr = arrays[stem]
        arr = arr.astype(np.int64 if f["dtype"] == "int64" else np.float32)
        np.save(os.path.join(a.out, f["name"]), arr)
        files[f["name"]] = {"shape": list(arr.shape), "dtype": f["dtype"],
                            "meaning": meanings[f["name"]]}
        if stem in RTOL and arr.size:
            scale = float(np.abs(arr).max())
            r = a.rtol if a.rtol is not None else RTOL[stem]
            tolerances[stem] = f"atol {max(r * scale, 1e-7):.3g} ({r:g} x max|ref| {scale:.4g})"
    tolerances["ids (input_ids, llm_input_ids, ple_ids, decode_ids, image_position_ids)"] = "exact"

    inputs = {"n_prompt_tokens": S, "n_decode": a.decode}
    if pixel_values is not None:
        valid = int((position_ids[0, :, 0] >= 0).sum().item())
        inputs.update({
            "image_hw": [rgb.height, rgb.width],
            "num_patches": valid,
            "max_patches": int(position_ids.shape[1]),
            "num_soft_tokens": valid // config.vision_config.pooling_kernel_size ** 2,
            "image_token_positions": [i for i, t in enumerate(ids) if t == config.image_token_id],
        })
    import transformers
    manifest = {
        "fixture": os.path.basename(os.path.normpath(a.out)),
        "generated_by": "scripts/hf_dump.py (Hugging Face transformers forward with hooks)",
        "model_dir": os.path.abspath(a.model) if os.path.isdir(a.model) else a.model,
        "weights_dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
        "compute": f"transformers {transformers.__version__}, torch {torch.__version__}, "
                   f"dtype {a.dtype}, device {a.device}, batch of one, no padding",
        "inputs": inputs,
        "decode": {"strategy": "greedy argmax (first index on ties)", "steps": a.decode,
                   "stopping": "none", "cache": "transformers KV cache"},
        "files": files,
        "tolerances": tolerances,
        "config": config.to_dict(),
    }
    with open(os.path.join(a.out, "manifest.json"), "w") as fh:
        json.dump(manifest, fh, indent=2, default=str)
    print(f"wrote {len(files)} files to {a.out}")


def main(argv=None):
    a = parse_args(sys.argv[1:] if argv is None else argv)
    if a.print_layout:
        json.dump({"files": LAYOUT}, sys.stdout, indent=1)
        sys.stdout.write("\n")
        return 0
    run(a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
