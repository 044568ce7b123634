"""A request that once made a worker's engine exit, sent to a real worker process: now a 400
naming the field, and the worker keeps serving."""

from server_utils import Worker, alive, engine_pid, get, post


def test_the_reported_request_no_longer_takes_a_worker_down():
    """The request that made a worker's engine exit (n siblings of a seed near 2^64): now a
    400 naming seed, and seeds at the top of int64 serve their siblings."""
    worker = Worker("--model", "tiny-random")
    try:
        pid = engine_pid(worker)
        url = worker.url + "/v1/completions"
        status, body = post(url, {"prompt": "hi", "n": 2, "seed": 18446744073709551615,
                                  "max_tokens": 1})
        assert status == 400 and body["error"]["param"] == "seed"
        status, body = post(url, {"prompt": "hi", "n": 2, "seed": 2**63 - 1, "max_tokens": 2})
        assert status == 200 and len(body["choices"]) == 2
        status, body = post(url, {"prompt": "hi", "max_tokens": 2})
        assert status == 200 and body["choices"][0]["finish_reason"] == "length"
        assert get(worker.url + "/health")[0] == 200 and alive(pid)
    finally:
        worker.close()
