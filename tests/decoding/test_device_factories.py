"""Issue 32 item 3: no tensor made on the default device inside the decode loops.

On a GPU a factory call without ``device=`` puts its tensor on the CPU; :class:`draftkit.testing.DeviceFactoryCheck`
records such calls from draftkit's own code while the real loops run on the CPU.
"""

import torch

from draftkit.testing import DeviceFactoryCheck

PROMPT = [256, 10, 72, 101, 108, 108, 111, 257, 10]


def test_the_check_catches_a_factory_without_device():
    """Fails on code that creates a tensor without a device (the check itself works)."""
    import draftkit.data.collate as collate_mod  # any draftkit module: the call site must lie in the package

    code = compile("def make():\n    return torch.zeros(3)\n", collate_mod.__file__, "exec")
    scope = {"torch": torch}
    exec(code, scope)
    with DeviceFactoryCheck() as check:
        scope["make"]()
        torch.zeros(2)  # from the test itself: not draftkit's code, not recorded
        torch.zeros(2, device="cpu")
    assert check.violations == [f"{collate_mod.__file__}:2 make"]


def test_decode_loops_make_every_tensor_on_the_target_device(tiny):
    from decoding_stubs import make_head

    from draftkit.decoding.drafters import Eagle3Drafter
    from draftkit.decoding.tree import Eagle3TreeDrafter, TreeConfig, generate_tree
    from draftkit.decoding.verify import generate_plain, generate_speculative
    from draftkit.sampling import DecodeConfig
    from draftkit.target.session import TargetSession

    target, _ = tiny
    head = make_head(target)
    session = TargetSession(target)
    prompt = torch.tensor(PROMPT)
    with DeviceFactoryCheck() as check:
        for temperature in (0.0, 1.0):
            cfg = DecodeConfig(max_new_tokens=12, temperature=temperature)
            g = torch.Generator().manual_seed(0)
            generate_plain(session, prompt, cfg, g)
            generate_speculative(session, Eagle3Drafter(head), prompt, 3, cfg, g, collect_kl=True)
            generate_tree(session, Eagle3TreeDrafter(head), prompt, TreeConfig(3, 2, 4), cfg, g)
    assert check.violations == [], "\n".join(check.violations)


def test_evaluate_harness_makes_every_tensor_on_the_target_device(tiny):
    """The harness around the loops: plain, head, prompt lookup, --tree auto's cost measurement and calibration."""
    from decoding_stubs import make_head

    from draftkit.decoding.harness import evaluate_head

    target, tokenizer = tiny
    head = make_head(target)  # module construction (then .to(device)) is not the loop
    with DeviceFactoryCheck() as check:
        evaluate_head(head, target, tokenizer, [PROMPT, PROMPT[:5]], k=3, max_new_tokens=8,
                      auto="tree", calibration_prompts=1, calibration_tokens=8)
    assert check.violations == [], "\n".join(check.violations)
