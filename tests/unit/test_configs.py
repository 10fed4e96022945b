"""Every YAML under cluster/ loads: Serve's schema, our args models, import paths."""

import importlib
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError
from ray.serve.schema import ServeDeploySchema

from deployments.pool_args import DrafterArgs, VerifierArgs
from deployments.router_args import RouterArgs

CLUSTER = Path(__file__).resolve().parents[2] / "cluster"
ARGS = {"drafter": DrafterArgs, "verifier": VerifierArgs, "router": RouterArgs}


def serve_configs():
    configs = {p.name: yaml.safe_load(p.read_text()) for p in CLUSTER.glob("*.yaml")}
    kuberay = configs.pop("kuberay.yaml")
    configs["kuberay.yaml:serveConfigV2"] = yaml.safe_load(kuberay["spec"]["serveConfigV2"])
    return configs


def unknown_serve_keys(config: dict) -> list[str]:
    """The keys of a Serve config that Serve's schema does not name where its models take any
    key and drop it (a deployment, its actor options, autoscaling and request router, an
    app): misspelled, an option would silently keep Serve's default (`max_ongoing_request`:
    5 calls a replica), or an app's `args` its defaults."""
    from ray.serve.config import AutoscalingConfig, AutoscalingPolicy, RequestRouterConfig
    from ray.serve.schema import (DeploymentSchema, HTTPOptionsSchema, RayActorOptionsSchema,
                                  ServeApplicationSchema, ServeDeploySchema, gRPCOptionsSchema)

    def names(model) -> set[str]:
        return {alias or name for name, field in model.model_fields.items()
                for alias in (field.alias, None)}

    found = []

    def check(where: str, given: dict, model) -> None:
        found.extend(f"{where}.{key}" for key in set(given) - names(model))

    check("", config, ServeDeploySchema)
    check("http_options", config.get("http_options", {}), HTTPOptionsSchema)
    check("grpc_options", config.get("grpc_options", {}), gRPCOptionsSchema)
    for app in config["applications"]:
        check(app["name"], app, ServeApplicationSchema)
        for deployment in app.get("deployments", []):
            where = f"{app['name']}.{deployment['name']}"
            check(where, deployment, DeploymentSchema)
            check(where, deployment.get("ray_actor_options", {}), RayActorOptionsSchema)
            autoscaling = deployment.get("autoscaling_config", {})
            check(f"{where}.autoscaling_config", autoscaling, AutoscalingConfig)
            check(f"{where}.autoscaling_config.policy", autoscaling.get("policy", {}),
                  AutoscalingPolicy)
            check(f"{where}.request_router_config",
                  deployment.get("request_router_config", {}), RequestRouterConfig)
    return found


@pytest.mark.parametrize("name, config", serve_configs().items())
def test_every_serve_key_is_one_serve_knows(name, config):
    """Serve's schema keeps what it does not know out of the deployment it builds; each key
    here is a field of its model, and what Serve leaves as plain dicts (autoscaling, the
    request router) validates as Serve reads it, naming code that imports."""
    from ray.serve.config import AutoscalingConfig, RequestRouterConfig

    assert unknown_serve_keys(config) == []
    for app in config["applications"]:
        for deployment in app["deployments"]:
            if "autoscaling_config" in deployment:
                policy = AutoscalingConfig.model_validate(
                    deployment["autoscaling_config"]).policy.policy_function
                module, attr = policy.split(":")
                assert callable(getattr(importlib.import_module(module), attr))
            if "request_router_config" in deployment:
                router = RequestRouterConfig.model_validate(
                    deployment["request_router_config"]).request_router_class
                module, attr = router.rsplit(".", 1)
                assert isinstance(getattr(importlib.import_module(module), attr), type)


def test_a_misspelled_serve_key_is_found():
    config = yaml.safe_load((CLUSTER / "gpu.yaml").read_text())
    router = config["applications"][2]
    router["arg"] = router.pop("args")
    deployment = router["deployments"][0]
    deployment["max_ongoing_request"] = deployment.pop("max_ongoing_requests")
    deployment["autoscaling_config"]["upscale_delay"] = 5
    ServeDeploySchema.model_validate(config)  # Serve's schema takes them
    assert sorted(unknown_serve_keys(config)) == [
        "router.Router.autoscaling_config.upscale_delay", "router.Router.max_ongoing_request",
        "router.arg"]


def test_every_yaml_is_covered():
    assert {p.name for p in CLUSTER.glob("*.yaml")} == {"config.yaml", "gpu.yaml", "kuberay.yaml"}


@pytest.mark.parametrize("name, config", serve_configs().items())
def test_config_validates_and_its_apps_build(name, config):
    schema = ServeDeploySchema.model_validate(config)
    assert {app.name for app in schema.applications} == set(ARGS)
    for function in config["grpc_options"]["grpc_servicer_functions"]:
        module, attr = function.rsplit(".", 1)
        assert callable(getattr(importlib.import_module(module), attr))
    for app in schema.applications:
        module, attr = app.import_path.split(":")
        assert callable(getattr(importlib.import_module(module), attr))
        ARGS[app.name].model_validate(app.args)  # unknown keys are errors
        for deployment in app.deployments:
            router = deployment.request_router_config
            if app.name != "router":
                assert router["request_router_class"].endswith("ConsistentHashRouter")
                # its kwargs are read with defaults: a misspelt key would leave strict
                # affinity (no fallback replica) silently off
                assert router["request_router_kwargs"] == {
                    "num_virtual_nodes": router["request_router_kwargs"]["num_virtual_nodes"],
                    "num_fallback_replicas": 0}


def test_each_app_builds_without_torch_and_its_replica_finds_its_class():
    """An app's build imports deployments.apps alone (no torch or transformers: it is a
    process of its own for each app); the class each deployment names by import path loads
    as a replica loads it (Serve's own loader), and the router's is the FastAPI ingress."""
    import subprocess
    import sys

    from ray.serve._private.http_util import ASGIAppReplicaWrapper
    from ray.serve._private.replica import _load_deployment_def_from_import_path

    from deployments import apps

    probe = "import sys, deployments.apps; print(sorted({'torch', 'transformers'} & " \
            "set(sys.modules)))"
    imported = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                              cwd=CLUSTER.parent, check=True).stdout.strip()
    assert imported == "[]"
    loaded = {}
    for deployment, module in ((apps.DrafterPool, "pools"), (apps.VerifierPool, "pools"),
                               (apps.Router, "router")):
        cls = loaded[deployment.name] = _load_deployment_def_from_import_path(
            deployment.func_or_class)
        assert isinstance(cls, type) and cls.__module__ == f"deployments.{module}"
        assert cls.__name__ == deployment.name
    assert issubclass(loaded["Router"], ASGIAppReplicaWrapper)


def test_kuberay_embeds_the_gpu_config_verbatim():
    kuberay = yaml.safe_load((CLUSTER / "kuberay.yaml").read_text())
    assert kuberay["kind"] == "RayService"
    assert yaml.safe_load(kuberay["spec"]["serveConfigV2"]) == \
        yaml.safe_load((CLUSTER / "gpu.yaml").read_text())


def kuberay_containers() -> dict[str, dict]:
    cluster = yaml.safe_load((CLUSTER / "kuberay.yaml").read_text())["spec"]["rayClusterConfig"]
    groups = {"head": cluster["headGroupSpec"]}
    groups.update((group["groupName"], group) for group in cluster["workerGroupSpecs"])
    return {name: group["template"]["spec"]["containers"][0] for name, group in groups.items()}


def test_kuberay_gives_every_pod_the_hub_token():
    """The example pair is gated on the hub, and any node may load from it (the pools'
    weights; the router's tokenizer and config, on the head or a GPU node): every Ray
    container reads HF_TOKEN from a Secret; before, none had it and each replica's start
    failed on the gated repository."""
    for name, container in kuberay_containers().items():
        env = {var["name"]: var for var in container.get("env", [])}
        assert "secretKeyRef" in env.get("HF_TOKEN", {}).get("valueFrom", {}), name


def test_kuberay_keeps_a_replaced_cluster_while_its_streams_finish():
    """A new image starts a new RayCluster and KubeRay deletes the old one, with the streams
    it still holds, RayClusterDeletionDelaySeconds after the switch (60 s by default): at least
    the router's graceful_shutdown_timeout_s, as a router replica Serve stops gets."""
    kuberay = yaml.safe_load((CLUSTER / "kuberay.yaml").read_text())
    serve = yaml.safe_load(kuberay["spec"]["serveConfigV2"])
    router = next(app for app in serve["applications"] if app["name"] == "router")
    grace = router["deployments"][0]["graceful_shutdown_timeout_s"]
    assert kuberay["spec"].get("rayClusterDeletionDelaySeconds", 60) >= grace


@pytest.mark.parametrize("name, config", serve_configs().items())
def test_a_stopped_router_replica_finishes_its_streams(name, config):
    """A router replica that a redeploy or a scale-down stops finishes its streams for
    graceful_shutdown_timeout_s, as long in every file: at Serve's 20 s default (the embedded
    config's, before), a redeploy of the router cut a stream of 2,000 tokens mid-way, without its
    error event or [DONE]."""
    def grace(serve_config: dict):
        router = next(app for app in serve_config["applications"] if app["name"] == "router")
        return router["deployments"][0].get("graceful_shutdown_timeout_s")

    gpu = yaml.safe_load((CLUSTER / "gpu.yaml").read_text())
    assert grace(config) == grace(gpu) >= 600


def test_gpu_config_puts_the_pools_on_different_gpu_classes():
    config = yaml.safe_load((CLUSTER / "gpu.yaml").read_text())
    options = {app["name"]: app["deployments"][0]["ray_actor_options"]
               for app in config["applications"]}
    assert options["drafter"]["accelerator_type"] != options["verifier"]["accelerator_type"]
    assert options["drafter"]["num_gpus"] == options["verifier"]["num_gpus"] == 1


def test_unknown_args_are_errors():
    with pytest.raises(ValidationError, match="extra"):
        DrafterArgs.model_validate({"modle": "x"})


@pytest.mark.parametrize("args, field", [
    ({"num_speculative_tokens": -1}, "num_speculative_tokens"),
    ({"num_speculative_tokens": 100}, "num_speculative_tokens"),  # past the pools' bound
    ({"default_max_tokens": 0}, "default_max_tokens"),
    ({"adaptive_k": {"min": 1, "max": 4, "initial": 6}}, "adaptive_k"),
    ({"busy_wait_s": float("inf")}, "busy_wait_s"),  # nothing waits unbounded
    ({"call_timeout_s": "inf"}, "call_timeout_s"),
    # finite, but past gRPC's int64 deadline: every pool call DEADLINE_EXCEEDED at once
    ({"call_timeout_s": 1e10}, "call_timeout_s"),
    ({"draft_timeout_s": 1e10}, "draft_timeout_s")])
def test_router_args_that_would_fail_every_request_fail_at_deploy(args, field):
    """Refused when the app starts, naming the arg; before, each request got the 400."""
    with pytest.raises(ValidationError) as refused:
        RouterArgs.model_validate(args)
    assert refused.value.errors()[0]["loc"][0] == field


@pytest.mark.parametrize("threads", [0, -2])
def test_a_pool_needs_a_torch_thread(threads):
    with pytest.raises(ValidationError, match="torch_threads"):
        DrafterArgs.model_validate({"model": "x", "torch_threads": threads})


@pytest.mark.parametrize("name, config", serve_configs().items())
def test_the_three_apps_name_the_same_target(name, config):
    """The drafter's `target` and the router's `model` are the verifier's model: the pools
    agree on its vocabulary and the router on its end tokens and context."""
    args = {app["name"]: ARGS[app["name"]].model_validate(app.get("args", {}))
            for app in config["applications"]}
    assert args["drafter"].target == args["verifier"].model == args["router"].model


@pytest.mark.parametrize("name, config", serve_configs().items())
def test_the_routers_admission_fits_the_pools_caches(name, config):
    """A running request is never evicted: per replica, the router's running choices at the
    full context fit each pool's token bound, and their sessions its session bound."""
    apps = {app["name"]: app for app in config["applications"]}
    router = RouterArgs.model_validate(apps["router"]["args"])
    context = router.max_context_tokens or 2048  # the demo target's
    for pool, args_model in (("drafter", DrafterArgs), ("verifier", VerifierArgs)):
        args = args_model.model_validate(apps[pool]["args"])
        assert router.max_running_requests <= args.max_cached_requests, pool
        assert router.max_running_requests * context <= args.max_cached_tokens, pool
    # the drafters the router runs itself, the same
    assert router.max_running_requests * context <= router.local_drafter_cached_tokens
    for app in config["applications"]:
        for deployment in app["deployments"]:
            assert deployment.get("max_queued_requests", -1) > 0, (app["name"], "unbounded queue")
    router_deployment = apps["router"]["deployments"][0]
    # the running and the waiting each hold one of Serve's slots on the router: beyond both,
    # a request still reaches the router and gets its 429, not a place in Serve's queue
    assert router_deployment["max_ongoing_requests"] > \
        router.max_running_requests + router.max_waiting_requests
    # a burst the router admits waits in Serve's queue while the router's loop is too busy
    # to answer the proxy's queue-length probe, instead of a 503 from Serve
    assert router_deployment["max_queued_requests"] >= router.max_running_requests
    # a router replica runs at most max_running_requests (beyond them requests wait): a
    # target at or above it would scale the router up only once requests wait
    target = router_deployment.get("autoscaling_config", {}).get("target_ongoing_requests")
    assert target is None or target < router.max_running_requests


@pytest.mark.parametrize("model, args, field", [
    (VerifierArgs, {"dtype": "bf16"}, "dtype"),  # before: the replica's ValueError
    (VerifierArgs, {"device": "gpu"}, "device"),  # before: torch's, after loading the weights
    (DrafterArgs, {"drafter": "medusa"}, "drafter"),
    (DrafterArgs, {"draft_top_k": -1}, "draft_top_k"),
    (DrafterArgs, {"draft_q_mass": 1.5}, "draft_q_mass"),
    (DrafterArgs, {"draft_q_mass": 0}, "draft_q_mass"),
    (DrafterArgs, {"drafter": "ngram", "ngram_min": 0}, "ngram_min"),
    (RouterArgs, {"max_context_tokens": -5}, "max_context_tokens"),
    (RouterArgs, {"served_model_name": []}, "served_model_name"),  # no name to answer with
    (RouterArgs, {"served_model_name": ""}, "served_model_name"),  # answers' model ""
    (RouterArgs, {"served_model_name": ["a", ""]}, "served_model_name"),
    (RouterArgs, {"served_model_name": ["a", "b", "a"]}, "served_model_name"),  # listed twice
    (VerifierArgs, {"session_ttl_s": float("inf")}, "session_ttl_s"),  # as the router's
    (DrafterArgs, {"health_stall_s": "inf"}, "health_stall_s"),
    (VerifierArgs, {"batch_linger": float("nan")}, "batch_linger"),
    (VerifierArgs, {"max_concurrent_rpcs": 2**31}, "max_concurrent_rpcs"),  # gRPC's C int
    (VerifierArgs, {"model": ""}, "model"),  # before: each replica's start, naming no arg
    (DrafterArgs, {"target": ""}, "target"),
    (RouterArgs, {"model": ""}, "model"),
    (RouterArgs, {"tokenizer": ""}, "tokenizer")])  # before: the model's, silently
def test_pool_and_router_args_a_replica_would_refuse_fail_at_deploy(model, args, field):
    with pytest.raises(ValidationError) as refused:
        model.model_validate(args)
    assert refused.value.errors()[0]["loc"][0] == field


def test_served_model_name_is_one_name_or_several_and_request_templates_are_untrusted():
    """vLLM's --served-model-name takes several (deployments.served_models); vLLM's
    --trust-request-chat-template is off by default (deployments.chat_templates)."""
    from deployments.served_models import served_names

    assert served_names(RouterArgs().served_model_name) == ("specserve-demo",)
    several = RouterArgs.model_validate({"served_model_name": ["a", "org/b"]})
    assert served_names(several.served_model_name) == ("a", "org/b")
    assert RouterArgs().trust_request_chat_template is False


def test_ngram_bounds_in_order_at_deploy():
    with pytest.raises(ValidationError, match="ngram_min"):
        DrafterArgs.model_validate({"drafter": "ngram", "ngram_min": 5, "ngram_max": 2})
    assert DrafterArgs.model_validate({"device": "cuda:1", "dtype": "bfloat16"}).device == "cuda:1"


def test_a_model_under_the_home_folder_is_expanded(monkeypatch, tmp_path):
    """check_model_path reads "~" as the home folder; transformers took the text for a
    malformed hub id ("Repo id must use alphanumeric chars")."""
    monkeypatch.setenv("HOME", str(tmp_path))
    expanded = str(tmp_path / "models" / "t")
    assert VerifierArgs(model="~/models/t").model == expanded
    assert DrafterArgs(target="~/models/t").target == expanded
    assert RouterArgs(model="~/models/t", tokenizer="~/models/t").tokenizer == expanded
    assert RouterArgs(model="meta-llama/Llama-3.1-8B-Instruct").model == \
        "meta-llama/Llama-3.1-8B-Instruct"


@pytest.mark.parametrize("key", ["", " sk-1", "sk-1\n", "clé"])
def test_an_api_key_no_client_could_send_fails_at_deploy(key):
    """Empty, the router was open (read as no key); with whitespace at an end or outside
    printable ASCII, no request's header ever matched it: every request a 401."""
    with pytest.raises(ValidationError) as refused:
        RouterArgs(api_key=key)
    assert refused.value.errors()[0]["loc"][0] == "api_key"
    assert RouterArgs(api_key="sk 1").api_key == "sk 1"


def test_an_api_key_from_the_environment_no_client_could_send_fails_the_start(monkeypatch):
    from deployments.ingress import API_KEY_ENV, api_key

    monkeypatch.setenv(API_KEY_ENV, "sk-1 ")
    with pytest.raises(ValueError, match=API_KEY_ENV):
        api_key(None)
    monkeypatch.setenv(API_KEY_ENV, "")  # set empty: unset
    assert api_key(None) is None and api_key("sk-2") == "sk-2"
