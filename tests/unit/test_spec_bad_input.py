"""Hostile and broken YAML cluster specs, each row a test (issue 8, section 3; more rows live in test_spec.py
and test_faults_inputs.py): keys that are not names, nesting bombs, YAML tags the safe loader refuses or
types pydantic refuses, non-finite and absurd numbers, prefill and decode layouts that cannot match, and a
wide bind without auth. Each must end in a `SpecError` naming the key (or line) and why -- never another
exception, never a spec accepted. A few rows that must still load (merge keys, differing page sizes) guard
against refusing too much."""
from __future__ import annotations

import pytest

from cluster.spec import load_spec
from cluster.spec_errors import SpecError

POOLS = "pools: {prefill: {}, decode: {}}\n"
M = "model: m\n"
DEEP = 20000

ROWS = {  # name: (YAML text, the key or line the error names, words of the reason)
    # structure
    "list as a key": (M + "? [a, b]\n: 1\n" + POOLS, "line 2, column 3", "a key must be a plain name"),
    "mapping as a key": (M + "? {a: 1}\n: 1\n" + POOLS, "line 2, column 3", "a key must be a plain name"),
    "integer key": (M + "1: 2\n" + POOLS, "[1]", "Keys should be strings"),
    "null key": (M + "~: 2\n" + POOLS, "None", "Keys should be strings"),
    "nested list bomb": (M + "pools: " + "[" * DEEP + "]" * DEEP + "\n", "", "nested too deeply"),
    "nested mapping bomb": (M + "x: " + "{a: " * 5000 + "1" + "}" * 5000 + "\n", "", "nested too deeply"),
    "NUL byte": ("\x00model: m\n", "", "special characters are not allowed"),
    "duplicate key in a pool": (M + "pools:\n  prefill: {replicas: 1, replicas: 2}\n  decode: {}\n", "line 3",
                                "duplicate key 'replicas'"),
    "duplicate key after a merge": ("b: &b {replicas: 1}\n" + M + "pools: {prefill: {<<: *b, kv: {}, kv: {}}}\n",
                                    "line 3", "duplicate key 'kv'"),
    # tags and types the safe loader or the schema refuse
    "python tuple tag": ("model: !!python/tuple [a, b]\n" + POOLS, "line 1", "python/tuple"),
    "custom tag": ("model: !Ref m\n" + POOLS, "line 1, column 8", "could not determine a constructor"),
    "binary model": ("model: !!binary aGVsbG8=\n" + POOLS, "model", "expected a string (got bytes)"),
    "set for pools": (M + "pools: !!set {prefill, decode}\n", "pools", "expected a mapping (got set)"),
    "date for model": ("model: 2001-12-14\n" + POOLS, "model", "expected a string (got date)"),
    "string for a number": (M + POOLS + "server: {request_timeout_s: '30'}\n", "server.request_timeout_s",
                            "expected a number (got a string)"),
    "boolean for an integer": (M + "pools: {prefill: {replicas: true}, decode: {}}\n", "pools.prefill.replicas",
                               "expected an integer (got a boolean)"),
    "list for a pool": (M + "pools: {prefill: [1], decode: {}}\n", "pools.prefill", "expected a mapping"),
    # unknown keys, deep down
    "unknown kv key": (M + "pools: {prefill: {kv: {pages: 4}}, decode: {}}\n", "pools.prefill.kv.pages",
                       "unknown key 'pages'"),
    "unknown eviction key": (M + "pools: {prefill: {kv: {eviction: {ratio: 0.5}}}, decode: {}}\n",
                             "pools.prefill.kv.eviction.ratio", "unknown key 'ratio'"),
    "unknown tls key": (M + POOLS + "kv_transfer: {tls: {cert_file: a, key_file: b, verify: false}}\n",
                        "kv_transfer.tls.verify", "unknown key 'verify'"),
    # non-finite and absurd numbers
    "infinite deadline": (M + POOLS + "server: {request_timeout_s: .inf}\n", "server.request_timeout_s",
                          "finite number"),
    "NaN slo": (M + POOLS + "slo: {tpot_ms: .nan}\n", "slo.tpot_ms", "finite number"),
    "NaN cpus": (M + "pools: {prefill: {resources: {num_cpus: .nan}}, decode: {}}\n",
                 "pools.prefill.resources.num_cpus", "finite number"),
    "infinite eviction budget": (M + "pools: {prefill: {kv: {eviction: {budget: .inf}}}, decode: {}}\n",
                                 "pools.prefill.kv.eviction.budget", "finite number"),
    "absurd replicas": (M + "pools: {prefill: {replicas: 100000000000000000000}, decode: {}}\n",
                        "pools.prefill.replicas", "less than or equal to 4096"),
    "max_replicas below replicas": (M + "pools: {prefill: {}, decode: {replicas: 3, max_replicas: 2}}\n",
                                    "pools.decode.max_replicas", "below replicas (3)"),
    "max_replicas zero": (M + "pools: {prefill: {}, decode: {max_replicas: 0}}\n", "pools.decode.max_replicas",
                          "greater than or equal to 1"),
    "absurd num_pages": (M + "pools: {prefill: {}, decode: {kv: {num_pages: 1000000000000}}}\n",
                         "pools.decode.kv.num_pages", "less than or equal to 16777216"),
    "absurd max_model_len": (M + "pools: {prefill: {max_model_len: 99999999999}, decode: {}}\n",
                             "pools.prefill.max_model_len", "less than or equal to 4194304"),
    "absurd batch": (M + "pools: {prefill: {max_num_batched_tokens: 99999999999}, decode: {}}\n",
                     "pools.prefill.max_num_batched_tokens", "less than or equal to"),
    "zero page size": (M + "pools: {prefill: {kv: {page_size: 0}}, decode: {}}\n", "pools.prefill.kv.page_size",
                       "greater than or equal to 1"),
    "negative cpus": (M + "pools: {prefill: {resources: {num_cpus: -1.0}}, decode: {}}\n",
                      "pools.prefill.resources.num_cpus", "greater than or equal to 0"),
    # prefill and decode layouts that cannot match
    "storage formats differ": (M + "pools: {prefill: {kv: {storage: int8}}, decode: {kv: {storage: fp8}}}\n",
                               "pools.decode.kv.storage", "both pools must use the same one"),
    "eviction on the decode pool": (M + "pools: {prefill: {}, decode: {kv: {eviction: {}}}}\n",
                                    "pools.decode.kv.eviction", "eviction runs where prompts are prefilled"),
    "speculation on the prefill pool": (M + "pools: {prefill: {speculative: {}}, decode: {}}\n",
                                        "pools.prefill.speculative", "prefill workers do not decode"),
    "unknown storage": (M + "pools: {prefill: {kv: {storage: int4}}, decode: {}}\n", "pools.prefill.kv.storage",
                        "must be one of raw, int8, fp8"),
    # wide binds without auth
    "HTTP on every interface": (M + POOLS + "server: {host: 0.0.0.0}\n", "server.api_key", "not loopback"),
    "HTTP on IPv6 any": (M + POOLS + "server: {host: '::'}\n", "server.api_key", "not loopback"),
    "KV on a LAN address": (M + POOLS + "kv_transfer: {host: 192.168.1.20}\n", "kv_transfer.auth_token",
                            "not loopback"),
    "KV on a host name": (M + POOLS + "kv_transfer: {host: node-1.example}\n", "kv_transfer.auth_token",
                          "not loopback"),
}


@pytest.mark.parametrize("name", list(ROWS))
def test_bad_spec_row(tmp_path, name):
    text, key, words = ROWS[name]
    path = tmp_path / "spec.yaml"
    path.write_text(text)
    with pytest.raises(SpecError) as err:
        load_spec(path)
    assert any(p.key.startswith(key) and words in p.reason for p in err.value.problems), str(err.value)


GOOD = {  # rows that must still load: (YAML text, check on the spec)
    "merge key": (M + "pools: {prefill: &b {replicas: 2, max_num_seqs: 8}, decode: {<<: *b, max_num_seqs: 4}}\n",
                  lambda s: (s.pools.decode.replicas, s.pools.decode.max_num_seqs) == (2, 4)),
    "page sizes differ (KV is re-paged on arrival)": (
        M + "pools: {prefill: {kv: {page_size: 8}}, decode: {kv: {page_size: 32}}}\n",
        lambda s: s.pools.decode.kv.page_size == 32),
    "same quantized storage": (M + "pools: {prefill: {kv: {storage: int8}}, decode: {kv: {storage: int8}}}\n",
                               lambda s: s.pools.prefill.kv.storage == "int8"),
    "wide binds with auth": (M + POOLS + "server: {host: 0.0.0.0, api_key: {env: K}}\n"
                             "kv_transfer: {host: 0.0.0.0, auth_token: {file: /run/token}}\n",
                             lambda s: s.server.host == s.kv_transfer.host == "0.0.0.0"),
}


@pytest.mark.parametrize("name", list(GOOD))
def test_good_spec_row(tmp_path, name):
    text, check = GOOD[name]
    path = tmp_path / "spec.yaml"
    path.write_text(text)
    assert check(load_spec(path))
