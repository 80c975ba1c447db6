"""The driver of tests/test_cross_node.py: run against a Ray cluster of two nodes that do not share
127.0.0.1 (the trainer's node with resource `trainer_node`, the reader's with `reader_node`).

    python tests/two_nodes.py RAY_ADDRESS

A trainer actor serves weight versions (weight_sync collective) and a reader actor on the other
node receives them; then the two join a trainer group (operators/trainer/collective.py) and
all-reduce. Prints one JSON line: what each side bound its listening sockets to and what it got.
The actor classes live in this script (`__main__`), so Ray ships them by value.
"""

from __future__ import annotations

import json
import sys
import time

import ray


def listening(pid: int | None = None) -> set[tuple[str, int]]:
    """The TCP (ip, port) this process listens on."""
    import psutil

    return {(c.laddr.ip, c.laddr.port) for c in psutil.Process(pid).net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN}


class Trainer:
    def __init__(self, store, weights: dict) -> None:
        from trajflow.operators.trainer.addresses import serving_host
        from trajflow.operators.trainer.weight_server import WeightServer
        from trajflow.operators.trainer.weight_sync import WeightSyncConfig

        self.before = listening()
        self.server = WeightServer(store, WeightSyncConfig(method="collective", bucket_mb=0.05, timeout_seconds=60),
                                   weights, ["float32"], host=serving_host())

    def host(self) -> str:
        return self.server.host

    def readers(self) -> int:
        return len(self.server.readers)

    def serve(self, version: int, weights: dict) -> list:
        """Send `version`; the sockets the server listens on (its store's, its link's to the reader)."""
        self.server.offer(version, weights.items())
        self.server.wait()
        return sorted(listening() - self.before)

    def open_group(self) -> int:
        from trajflow.operators.trainer.addresses import serving_host
        from trajflow.operators.trainer.collective import listening_socket

        self.listen = listening_socket(serving_host())
        return self.listen.getsockname()[1]

    def all_reduce(self, value: float) -> dict:
        import torch

        from trajflow.operators.trainer.collective import Collective

        before = listening()
        host = self.listen.getsockname()[0]
        self.collective = Collective(0, 2, host=host, listen=self.listen, timeout_seconds=60)
        total = self.collective.all_reduce_sum(torch.tensor([value]))
        return {"sum": float(total), "sockets": sorted(listening() - before)}


class Reader:
    def __init__(self, store) -> None:
        from trajflow.operators.trainer.weight_receiver import WeightReceiver
        from trajflow.operators.trainer.weight_sync import WeightSyncConfig

        self.before = listening()
        self.receiver = WeightReceiver(store, WeightSyncConfig(method="collective", bucket_mb=0.05, timeout_seconds=60),
                                       "float32", history=False)

    def node_ip(self) -> str:
        return ray.util.get_node_ip_address()

    def weights(self, version: int) -> tuple[dict, list]:
        got = {k: v.clone() for k, v in self.receiver.weights(version).items()}
        return got, sorted(listening() - self.before)

    def all_reduce(self, host: str, port: int, value: float) -> dict:
        import torch

        from trajflow.operators.trainer.collective import Collective

        before = listening()
        collective = Collective(1, 2, host=host, port=port, timeout_seconds=60)
        total = collective.all_reduce_sum(torch.tensor([value]))
        return {"sum": float(total), "sockets": sorted(listening() - before)}


def main(address: str) -> dict:
    import torch

    from trajflow.engines.models import build_tiny_model
    from trajflow.pipelines.policy_store import RayStore

    ray.init(address=address, configure_logging=False, log_to_driver=False)
    weights = {k: v.detach().clone() for k, v in build_tiny_model(0)[0].state_dict().items()}
    store = RayStore.start(max_staleness=1, keep_history=False)
    store.publish(weights, 0)
    trainer = ray.remote(Trainer).options(num_cpus=0, resources={"trainer_node": 1}).remote(store, weights)
    reader = ray.remote(Reader).options(num_cpus=0, resources={"reader_node": 1}).remote(store)
    deadline = time.monotonic() + 120
    while ray.get(trainer.readers.remote()) < 1:  # the reader joined from its node
        assert time.monotonic() < deadline, "the reader never joined the trainer's server"
        time.sleep(0.1)
    version_1 = {k: v + 1 for k, v in weights.items()}
    trainer_sockets = ray.get(trainer.serve.remote(1, version_1))
    got, reader_sockets = ray.get(reader.weights.remote(1))
    bitwise = all(torch.equal(got[k], v) for k, v in version_1.items())
    port = ray.get(trainer.open_group.remote())
    host = ray.get(trainer.host.remote())
    group = ray.get([trainer.all_reduce.remote(1.0), reader.all_reduce.remote(host, port, 2.0)])
    return {"nodes": sorted(n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]),
            "server_host": host, "reader_ip": ray.get(reader.node_ip.remote()),
            "server_sockets": trainer_sockets, "reader_sockets": reader_sockets, "bitwise": bitwise, "version": store.latest_version(),
            "group": group}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1])), flush=True)
