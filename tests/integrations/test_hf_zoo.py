

# The semantics added for these architectures, through the Triton kernels (the interpreter here):
# transposed interleaved biased experts, the bounded SiLU gates, relu, identity experts, I = 1.
TRITON_ARCHS = ["gpt_oss", "deepseek_v4", "step3p7", "inkling2", "switch_transformers", "longcat_flash", "doge"]


@pytest.mark.parametrize("arch", TRITON_ARCHS)
def test_triton_kernels_serve_the_added_semantics(arch, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    model = hf_zoo.build(arch)
    kw = hf_zoo.inputs(model)
    with torch.no_grad():
        want = _out(model(**kw))
        patch(model, backend="triton")
        got = _out(model(**kw))
    assert rel_error(got, want) < FP32_TOL, arch
