"""Mesh construction from config: -1, device-count mismatch, bad sizes."""
import jax
import pytest

from errors import ShardingError
from partitioning import devices_needed, make_mesh, resolve_mesh_shape


def test_mesh_from_config_keeps_order_and_auto_axes():
  mesh = make_mesh({'data': 2, 'fsdp': 2, 'tensor': 2})
  assert dict(mesh.shape) == {'data': 2, 'fsdp': 2, 'tensor': 2}
  assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)


def test_minus_one_takes_the_rest():
  assert resolve_mesh_shape({'data': -1, 'tensor': 2}, 8) == {'data': 4, 'tensor': 2}
  assert devices_needed({'data': -1, 'tensor': 2}) == 2


def test_one_device_mesh():
  mesh = make_mesh({'data': 1, 'fsdp': 1, 'tensor': 1}, devices=jax.devices()[:1])
  assert mesh.size == 1


def test_product_mismatch_says_how_many_devices():
  with pytest.raises(ShardingError, match=r'config.mesh \(data=2 x fsdp=2\) needs 4 devices, but there are 8 cpu'):
    make_mesh({'data': 2, 'fsdp': 2})


@pytest.mark.parametrize('cfg, msg', [
    ({'data': -1, 'fsdp': -1}, 'more than one -1'),
    ({'data': 0}, r'config.mesh.data = 0'),
    ({'data': 3, 'fsdp': -1}, 'fixed axes take 3 devices, which does not divide the 8'),
    ({}, 'config.mesh is empty'),
])
def test_bad_mesh(cfg, msg):
  with pytest.raises(ShardingError, match=msg):
    resolve_mesh_shape(cfg, 8, 'cpu')
