"""The trainer with a third kind of data source, given through the `data_source` extension point
(diffusion_extras.training.hooks): images whose value is the micro-step, a position counted in
batches served. If the loop, checkpoints, resume and artifacts use only the data-source
interface, it trains."""
import numpy as np
import torch

from diffusion_extras.training.main import Hooks, finish, main


class CountingSource:
    batches_per_epoch = 5
    description = "counting"
    held_out_images = None

    def __init__(self, spec, processes, channels, dataset=None, validation_split=0.0, classes=None):
        self.spec, self.channels, self.served = spec, channels, 0

    def _batch(self, micro_step):
        value = micro_step % 255
        shape = (self.spec.train_batch_size, self.channels, self.spec.resolution, self.spec.resolution)
        return torch.full(shape, value, dtype=torch.uint8)

    def batches(self, first, last):
        print(f"counting source: batches from {first} to {last}, served so far {self.served}", flush=True)
        for micro_step in range(first, last):
            self.served += 1
            yield self._batch(micro_step)

    def position(self, micro_step):
        return {"epoch": micro_step // 5, "batch_in_epoch": micro_step % 5}

    def state_dict(self):
        return {"served": self.served}

    def load_state_dict(self, state):
        self.served = state["served"]

    def reference_sample(self, count):
        return np.stack([self._batch(k)[0].numpy() for k in range(min(count, 8))])


if __name__ == "__main__":
    finish(main(hooks=Hooks(data_source=CountingSource)))  # exits as train_ddpm.py does
