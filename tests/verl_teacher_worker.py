"""verl 0.9.1's reference worker in ``rlfuse.integrations.verl_gr_opd``'s config, built and run
as verl's legacy trainer runs it (``init_model``, then the trainer's ``_compute_ref_log_prob`` on
a left/right-padded batch), on this CPU, one process, printing JSON: the reference log-probs
of ``TeacherReferenceWorker`` (``--teacher``) or of verl's own worker (``--stock``), and the
teacher's and the student's own, by transformers in fp32.

verl's engines run on CUDA or NPU only: this process lends verl a CPU platform (its device
``cpu``, ``gloo``, no pinned memory, its FSDP2 engine registered for ``cpu``) and no more;
the worker, the engine, the model loading and the trainer's method are verl's."""
import datetime
import json
import os
import socket
import sys
import tempfile
import types

import torch

V, B, P, R = 64, 4, 3, 5


def lend_verl_a_cpu() -> None:
    import verl.models.transformers.monkey_patch as monkey_patch
    import verl.workers.engine.fsdp.transformer_impl as fsdp_engine
    from verl.plugin.platform import platform_manager
    from verl.plugin.platform.platform_cuda import PlatformCUDA
    from verl.workers.engine.base import EngineRegistry

    device = types.SimpleNamespace(**{k: getattr(torch.cpu, k) for k in dir(torch.cpu)
                                      if not k.startswith("__")})
    for name in ("memory_reserved", "memory_allocated", "max_memory_allocated",
                 "max_memory_reserved"):
        setattr(device, name, lambda *a, **k: 0)
    device.empty_cache, device.mem_get_info = (lambda: None), (lambda *a: (0, 0))

    class PlatformCPU(PlatformCUDA):
        device_name = property(lambda self: "cpu")
        device_module = property(lambda self: device)

        def is_available(self):
            return True

        def device_count(self):
            return 1

        def current_device(self):
            return "cpu"

        def set_device(self, *args):
            pass

        synchronize = empty_cache = set_allocator_settings = set_device

        def manual_seed(self, seed):
            torch.manual_seed(seed)

        manual_seed_all = manual_seed

        def communication_backend_name(self):
            return "gloo"

    platform_manager._current_platform = PlatformCPU()
    engines = EngineRegistry._engines["language_model"]
    for backend in ("fsdp", "fsdp2"):
        engines[backend]["cpu"] = engines[backend]["cuda"]
    policy = fsdp_engine.CPUOffloadPolicy
    fsdp_engine.CPUOffloadPolicy = lambda pin_memory=True: policy(pin_memory=False)
    monkey_patch.is_trl_available = lambda: False    # TRL 1.16 lacks the value head verl asks


def tiny(seed: int, folder: str):
    import transformers

    torch.manual_seed(seed)
    model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64))
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)    # log-probs far apart per model
    model.save_pretrained(folder)
    return model


def batch():
    """verl's rollout batch: prompts left-padded, responses right-padded."""
    from verl import DataProto

    gen = torch.Generator().manual_seed(1)
    prompts, responses = torch.randint(1, V, (B, P), generator=gen), \
        torch.randint(1, V, (B, R), generator=gen)
    prompt_mask = (torch.arange(P) >= P - torch.tensor([3, 2, 3, 1])[:, None]).long()
    response_mask = (torch.arange(R) < torch.tensor([5, 3, 1, 4])[:, None]).long()
    attention = torch.cat([prompt_mask, response_mask], 1)
    ids = torch.cat([prompts * prompt_mask, responses * response_mask], 1)
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    data = DataProto.from_dict({"input_ids": ids, "attention_mask": attention,
                                "position_ids": positions, "prompts": prompts * prompt_mask,
                                "responses": responses * response_mask,
                                "response_mask": response_mask})
    data.meta_info["temperature"] = 1.0
    return data


def own_log_probs(model, data):
    with torch.no_grad():
        logits = model(input_ids=data.batch["input_ids"],
                       attention_mask=data.batch["attention_mask"],
                       position_ids=data.batch["position_ids"]).logits.float()
    ids = data.batch["input_ids"]
    lp = torch.log_softmax(logits[:, P - 1:-1], -1).gather(-1, ids[:, P:, None]).squeeze(-1)
    return lp * data.batch["response_mask"]


def main(which: str) -> dict:
    with socket.socket() as free:       # a port no other test holds
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    import torch.distributed as dist
    from hydra import compose, initialize_config_module
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer
    from verl.workers.engine_workers import ActorRolloutRefWorker

    from rlfuse.integrations import verl_gr_opd

    lend_verl_a_cpu()
    folder = tempfile.mkdtemp()
    student, teacher = tiny(0, f"{folder}/student"), tiny(1, f"{folder}/teacher")
    with initialize_config_module(config_module="rlfuse.integrations.verl",
                                  version_base=None):
        config = compose("rlfuse_gr_opd", overrides=[
            f"algorithm.rlfuse_gr_opd.teacher={folder}/teacher",
            f"actor_rollout_ref.model.path={folder}/student", "trainer.device=cpu",
            "actor_rollout_ref.actor.strategy=fsdp2", "actor_rollout_ref.rollout.n=2",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4", "data.train_batch_size=2",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
            "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2",
            "actor_rollout_ref.ref.fsdp_config.param_offload=False",
            "++actor_rollout_ref.ref.fsdp_config.mixed_precision.param_dtype=fp32",
            "+actor_rollout_ref.model.override_config.attn_implementation=eager"])
    dist.init_process_group("gloo", store=dist.FileStore(f"{folder}/store", 1), rank=0,
                            world_size=1, timeout=datetime.timedelta(seconds=120))
    cls = verl_gr_opd.teacher_reference_worker(config.algorithm.rlfuse_gr_opd.teacher) \
        if which == "--teacher" else ActorRolloutRefWorker
    worker = cls(config.actor_rollout_ref, role="ref")
    worker.init_model()
    data = batch()
    trainer = types.SimpleNamespace(ref_in_actor=False, ref_policy_wg=worker)
    ref = RayPPOTrainer._compute_ref_log_prob(trainer, data).batch["ref_log_prob"]
    mask = data.batch["response_mask"]
    model = worker.config.model
    return {"ref": (ref * mask).tolist(), "teacher": own_log_probs(teacher, data).tolist(),
            "student": own_log_probs(student, data).tolist(), "mask": mask.tolist(),
            "weights": model.path.replace(folder, ""),
            "tokenizer": (model.get("tokenizer_path") or model.path).replace(folder, "")}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1])))
