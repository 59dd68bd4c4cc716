"""The model runner: the replicas, the processor and chat template, and one forward over a cache.

What a step needs to run (`stepping.py`), the pacer's calibration and the start-up self-check
depend on this, not on the engine's facade (`engine.py`), which adds sessions and turns on top.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache

from llava.core.config import ServerConfig
from llava.core.families import check_model_type
from llava.engines.conversation.chat import ChatFormatter
from llava.engines.transformers.decoding.decoder import Decoder
from llava.engines.transformers.model.forward import forward
from llava.engines.transformers.model.packed import enable_packing
from llava.engines.transformers.model.vision import image_token_id, tower_ratio, vision_part
from llava.engines.transformers.model.workspace import Workspace
from llava.engines.transformers.scheduling.pacing import StepCosts, StepPacer
from llava.engines.transformers.state.imageset import ImageEncoder
from llava.engines.transformers.state.session import Replica

DEFAULT_STEP_BUDGET = 256  # tokens per step for engines built without `load` (not calibrated)


class ModelRunner:
    """Hold one model replica per device and what feeding it needs; run a forward."""

    def __init__(self, processor: Any, replicas: list[Replica], config: ServerConfig) -> None:
        self.processor = processor
        self.tokenizer = processor.tokenizer
        self.replicas = replicas
        self.config = config
        self.chat = ChatFormatter(processor)
        model = replicas[0].model
        self.image_token_id = image_token_id(model)
        text_config = model.config.get_text_config()
        family = check_model_type(model.config.model_type, "the loaded model")
        self.images = ImageEncoder(
            processor,
            self.image_token_id,
            keep_pixels=config.cache_mode != "kv",
            joint=family.joint_images,
            multi_image=family.multi_image(text_config.model_type),
            max_images=config.max_images_per_session,
            # On the CPU the image processes run the tower as well: the same cores, but off
            # the step loop, which then never holds a stream for a tower run.
            vision=vision_part(model) if self._tower_in_preparer(config, replicas) else None,
        )
        self.max_context = config.max_context_tokens or text_config.max_position_embeddings
        self.num_layers = text_config.num_hidden_layers
        eos = model.generation_config.eos_token_id
        if eos is None:
            eos = self.tokenizer.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [eos])
        self.workspace = Workspace.of(model)
        self.decoder = Decoder(replicas, self.forward, self.eos_ids, self.workspace)
        # A step's chunks and decodes share one forward per replica where the model allows it.
        self.packs = all([enable_packing(r.model) for r in replicas])
        # A configured budget counts tokens only, the tower costed by parameter counts; `load`
        # calibrates a pacer instead when the budget is left to it (step_token_budget: 0).
        budget = config.step_token_budget or DEFAULT_STEP_BUDGET
        self.fixed_costs = StepCosts(budget, tower_ratio(model), 0, 0)
        self.pacer: StepPacer | None = None

    @property
    def workspace_reserve(self) -> int | None:
        """Bytes a step's forward may allocate beyond the caches (None: unbounded)."""
        return self.decoder.workspace_reserve

    @staticmethod
    def _tower_in_preparer(config: ServerConfig, replicas: list[Replica]) -> bool:
        """Tell whether image processes run the vision tower: a CPU model caching KV."""
        on_cpu = all(r.device.type == "cpu" for r in replicas)
        return on_cpu and config.cache_mode == "kv" and config.image_processes > 0

    @property
    def keeps_kv(self) -> bool:
        return self.config.cache_mode == "kv"

    def forward(
        self,
        replica: Replica,
        cache: DynamicCache,
        ids: list[int],
        features: torch.Tensor | None,
        offset: int,
    ) -> torch.Tensor:
        """Feed ids (image tokens from `features[offset:]`); return the last logits row
        (transactional: a forward that fails cuts every layer of the cache back)."""
        return forward(replica.model, cache, ids, self.image_token_id, features, offset)
