"""Run by test_placement.py in its own process: a 3-node local Ray cluster whose nodes carry
custom resources standing in for GPU classes; the pools must land on their class only."""

import json

from deployments.local import app_config, deploy, load_config, on_free_ports, start_serve


def main() -> None:
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    small = cluster.add_node(num_cpus=1, resources={"gpu_class_small": 2})
    large = cluster.add_node(num_cpus=1, resources={"gpu_class_large": 2})
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, logging_level="warning")
    try:
        config = on_free_ports(load_config())
        for name, resource in (("drafter", "gpu_class_small"), ("verifier", "gpu_class_large")):
            options = app_config(config, name)["deployments"][0]
            options["num_replicas"] = 2
            options["ray_actor_options"] = {"num_cpus": 0.1, "resources": {resource: 1}}
        app_config(config, "router")["deployments"][0]["ray_actor_options"] = {"num_cpus": 0.1}
        start_serve(config)
        deploy(config, timeout_s=240)
        where = {}
        for app, deployment in (("drafter", "DrafterPool"), ("verifier", "VerifierPool")):
            handle = serve.get_deployment_handle(deployment, app)
            where[app] = sorted({handle.where.remote().result() for _ in range(20)})
        print("PLACEMENT " + json.dumps({"small": small.node_id, "large": large.node_id,
                                        "where": where}), flush=True)
    finally:
        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main()
