"""--load-format dummy through `up`: the workers and the orchestrator's token counter read
the config alone."""


def test_up_serves_a_dummy_model_and_its_orchestrator_counts_with_its_tokenizer(tmp_path):
    from server_utils import UpCluster, post
    # kv_aware: the orchestrator loads the workers' tokenizer, as the workers do, config only
    up = UpCluster("--model", "tiny-llama", "--load-format", "dummy", "--dtype", "float32",
                   "--kv-cache-gib", "0.05", "--ctx-router", "kv_aware",
                   log=str(tmp_path / "up.log"))
    try:
        status, body = post(up.url + "/v1/chat/completions", {
            "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 5,
            "temperature": 0, "ignore_eos": True})
    finally:
        up.close()
    assert status == 200, body
    assert body["usage"]["completion_tokens"] == 5
