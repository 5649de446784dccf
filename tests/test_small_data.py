"""A folder smaller than the recipe's batch (a user's first try on their own images): with no
--train_batch_size given the batch follows the data, as the model does, said in one line; a batch
the user gave is kept and refused with the fix."""
import pytest
import yaml
from helpers import run_training, save_random_images

from diffusion_extras.data.batch_order import fitted_batch_size


def recipe_without_a_batch(tiny_recipe, folder):
    """The tiny recipe with no train_batch_size in it: the default (64) applies and nobody chose it."""
    values = yaml.safe_load(open(tiny_recipe()))
    del values["train_batch_size"]
    path = folder / "no-batch.yaml"
    path.write_text(yaml.safe_dump(values))
    return path


@pytest.mark.parametrize("count, batch, processes, fitted", [(40, 64, 1, 40), (1797, 64, 1, 64), (40, 64, 2, 20),
                                                             (41, 64, 2, 20), (1, 64, 2, 1)])
def test_the_batch_fits_the_data_set(count, batch, processes, fitted):
    assert fitted_batch_size(count, batch, processes) == fitted


def test_a_small_folder_trains_with_a_batch_of_its_size_unless_a_batch_was_given(tiny_recipe, tmp_path):
    images = save_random_images(tmp_path / "my_images", 40, 8, 8)
    recipe = recipe_without_a_batch(tiny_recipe, tmp_path)
    result = run_training(recipe, tmp_path / "run", "--train_data_dir", images, "--max_train_steps", 1,
                   "--checkpointing_steps", 1)
    assert ("data: 40 training images, fewer than the recipe's batch of 64: training with --train_batch_size 40 "
            "(give one to choose)\n") in result.stdout
    assert yaml.safe_load(open(tmp_path / "run" / "training_config.yaml"))["train_batch_size"] == 40
    # the same command resumes: the batch is fitted again, as the checkpoint recorded it (a changed batch is refused)
    run_training(recipe, tmp_path / "run", "--train_data_dir", images, "--max_train_steps", 2,
                 "--checkpointing_steps", 1, "--resume_from_checkpoint", "latest")
    assert (tmp_path / "run" / "checkpoint-2").is_dir()
    refused = run_training(recipe, tmp_path / "given", "--train_data_dir", images, "--max_train_steps", 2,
                    "--train_batch_size", 64, check=False)
    assert refused.returncode == 2
    assert "is larger than the dataset (40 images); lower --train_batch_size" in refused.stderr
