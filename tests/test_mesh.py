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


@pytest.mark.parametrize(
  'cfg, msg',
  [
    ({'data': -1, 'fsdp': -1}, 'more than one -1'),
    ({'data': 0}, r'config.mesh.data = 0'),
    ({'data': 3, 'fsdp': -1}, 'fixed axes take 3 devices, which does not divide the 8'),
    ({}, 'config.mesh is empty'),
  ],
)
def test_bad_mesh(cfg, msg):
  with pytest.raises(ShardingError, match=msg):
    resolve_mesh_shape(cfg, 8, 'cpu')


def test_hybrid_mesh_puts_the_slices_outermost_and_checks_them():
  """config.dcn_mesh: in one process, contiguous blocks of devices stand for slices; each axis is ICI x DCN with
  the DCN factor outermost, so an axis split over DCN changes slice every mesh[a] positions."""
  from partitioning import dcn_coordinates, describe_dcn, num_slices  # pylint: disable=g-import-not-at-top

  mesh = make_mesh({'data': 2, 'fsdp': 2}, dcn_cfg={'data': 1, 'fsdp': 2})
  assert dict(mesh.shape) == {'data': 2, 'fsdp': 4}
  assert [[d.id for d in row] for row in mesh.devices] == [[0, 1, 4, 5], [2, 3, 6, 7]]  # slice 1 = devices 4-7
  assert dcn_coordinates(mesh, {'fsdp': 2}).tolist() == [0, 0, 1, 1, 0, 0, 1, 1]
  assert num_slices(mesh, {'fsdp': 2}) == 2
  assert describe_dcn(mesh, {'fsdp': 2}).startswith('fsdp=2 across slices x data=2 x fsdp=2 within each')
  assert devices_needed({'data': -1, 'fsdp': 2}, {'data': 2}) == 4
  with pytest.raises(ShardingError, match=r"config.dcn_mesh.tensor: 'tensor' is not an axis of config.mesh"):
    make_mesh({'data': 2, 'fsdp': 4}, dcn_cfg={'tensor': 2})
  with pytest.raises(
    ShardingError,
    match=r'config.dcn_mesh \(data=3 x fsdp=1\) asks for 3 slices, which does not '
    r'divide the 8 cpu devices',
  ):
    make_mesh({'data': 1, 'fsdp': -1}, dcn_cfg={'data': 3})
  with pytest.raises(
    ShardingError,
    match=r'needs 8 devices, but there are 4 cpu devices.*per slice: '
    r'config.dcn_mesh \(data=2 x fsdp=1\) splits the 8 devices into 2 slices',
  ):
    make_mesh({'data': 1, 'fsdp': 8}, dcn_cfg={'data': 2})
