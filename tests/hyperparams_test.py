"""Params: define, set, get, copy, freeze, iterate, text round trips, errors."""

import re

import pytest
import tensorflow as tf

from lingvo_gpipe.core import hyperparams, layers, lr_schedules, optimizers
from lingvo_gpipe.core.hyperparams import InstantiableParams, Params, ParamsError
from lingvo_gpipe.inputs.synthetic_images import SyntheticImages


class Widget:
  def __init__(self, params):
    self.params = params


def make_params() -> Params:
  inner = Params()
  inner.define("dim", 8, "")
  inner.define("scale", 0.5, "")
  p = Params()
  p.define("name", "net", "")
  p.define("flag", False, "")
  p.define("count", 3, "")
  p.define("rate", 0.1, "")
  p.define("shape", [1, 2], "")
  p.define("window", (2, 2), "")
  p.define("table", {"a": 1}, "")
  p.define("dtype", tf.float32, "")
  p.define("kind", Widget, "")
  p.define("nothing", None, "")
  p.define("inner", inner, "")
  p.define("layers", [inner.copy(), inner.copy().set(dim=16)], "")
  return p


def test_define_set_get_chained_and_dotted():
  p = make_params()
  assert p.set(count=4).set(**{"inner.dim": 32}) is p
  assert p.count == 4 and p.inner.dim == 32 and p.get("inner.dim") == 32
  p.set(**{"layers[1].scale": 2.0})
  assert p.layers[1].scale == 2.0 and p.get("layers[1].scale") == 2.0
  with pytest.raises(ParamsError, match="already defined"):
    p.define("count", 1, "")


def test_unknown_key_suggests_closest():
  p = make_params()
  with pytest.raises(AttributeError, match=r"'cuont'.*'count'"):
    p.cuont = 3
  with pytest.raises(ParamsError, match=r"'inner.dimm'.*'dim'"):
    p.set(**{"inner.dimm": 1})
  with pytest.raises(ParamsError, match=r"'innr'.*'inner'"):
    p.get("innr.dim")


def test_copy_is_deep_and_freeze_is_recursive():
  p = make_params()
  q = p.copy()
  q.inner.dim = 99
  q.shape.append(3)
  q.layers[0].dim = 77
  assert p.inner.dim == 8 and p.shape == [1, 2] and p.layers[0].dim == 8
  p.freeze()
  for setter in (lambda: setattr(p, "count", 1), lambda: setattr(p.inner, "dim", 1),
                 lambda: p.layers[1].set(dim=1)):
    with pytest.raises(ParamsError, match="frozen"):
      setter()
  r = p.copy()
  r.inner.dim = 5  # a copy of frozen params is not frozen
  assert not r.is_frozen and p.is_frozen


def test_iterate_and_flatten():
  p = make_params()
  assert [k for k, _ in p.iter_params()][:3] == ["name", "flag", "count"]
  flat = dict(p.flatten())
  assert flat["inner.dim"] == 8 and flat["layers[1].dim"] == 16


def test_text_round_trip_every_type():
  p = make_params()
  q = make_params().set(name="x y", flag=True, count=-5, rate=2.5e-3, shape=[3, 4, 5],
                        window=(7,), table={"b": [1, 2]}, dtype=tf.bfloat16, kind=Params,
                        nothing=7)
  q.inner.dim = 1
  q.layers[1].scale = 0.25
  text = q.to_text()
  lines = text.strip().split("\n")
  assert lines == sorted(lines)
  assert "inner.dim : 1" in lines and "dtype : bfloat16" in lines
  assert "kind : lingvo_gpipe.core.hyperparams.Params" in lines
  p.from_text(text)
  assert p.to_text() == text
  assert p.kind is Params and p.dtype == tf.bfloat16 and p.window == (7,)
  assert p.table == {"b": [1, 2]} and p.name == "x y" and p.nothing == 7


def test_from_text_type_errors_name_key_and_type():
  p = make_params()
  for key, value, expected in [("count", "1.5", "int"), ("flag", "maybe", "bool"),
                               ("rate", "'fast'", "float"), ("shape", "3", "list"),
                               ("dtype", "float33", "dtype"), ("kind", "no.such.Class", "class"),
                               ("inner.dim", "x", "int")]:
    with pytest.raises(ParamsError, match=rf"'{key}'.*expected {expected}"):
      p.set_from_text(key, value)
  with pytest.raises(ParamsError, match="nested Params"):
    p.set_from_text("inner", "3")


def test_override_texts_take_their_defaults_kind_only():
  """A bool is true or false (not 1 or 0); a str is not a bare number (quote it); None
  is taken by a str as "not set", and refused where the kind cannot be None (a class,
  an int, a list)."""
  p = make_params()
  for key, value, expected in [("flag", "1", "bool"), ("flag", "0", "bool"),
                               ("name", "7", "str"), ("name", "1.5", "str"),
                               ("kind", "None", "class"), ("count", "None", "int"),
                               ("shape", "None", "list")]:
    with pytest.raises(ParamsError, match=rf"'{key}'.*expected {expected}"):
      p.set_from_text(key, value)
  p.set_from_text("name", "'7'")
  p.set_from_text("flag", "True")
  assert (p.name, p.flag) == ("7", True)
  p.set_from_text("name", "None")
  assert p.name is None
  # A param whose default is None takes None again whatever it holds now (a float an
  # override set: a resume's params.txt of None was refused as "not a value of it").
  p.define("cap", None, "")
  p.set_from_text("cap", "0.5")
  assert p.cap == 0.5
  p.set_from_text("cap", "None")
  assert p.cap is None


def test_parse_overrides_respects_quotes_and_brackets():
  got = hyperparams.parse_overrides('a.b=1; c.d="x;y" ;e=[1, 2];f={"k": 1}')
  assert got == [("a.b", "1"), ("c.d", '"x;y"'), ("e", "[1, 2]"), ("f", '{"k": 1}')]
  with pytest.raises(ParamsError, match="no '='"):
    hyperparams.parse_overrides("a.b")


def test_instantiable_params_build_from_frozen_copy():
  p = InstantiableParams(Widget)
  p.define("size", 2, "")
  w = p.instantiate()
  assert isinstance(w, Widget) and w.params.is_frozen and w.params.size == 2
  assert not p.is_frozen
  with pytest.raises(ParamsError, match="cls"):
    InstantiableParams().instantiate()


@pytest.mark.parametrize("params", [
    layers.Linear.Params().set(input_dim=2, output_dim=3),
    optimizers.SGD.Params(),
    lr_schedules.CosineDecay.Params(),
    SyntheticImages.Params(),
], ids=["layer", "optimizer", "lr_schedule", "input"])
def test_everything_built_from_params_shares_one_base_that_refuses_unfrozen_params(params):
  assert issubclass(params.cls, hyperparams.Instantiable)
  with pytest.raises(ParamsError, match=f"{params.cls.__name__} must be built from frozen"):
    params.cls(params)
  assert isinstance(params.instantiate(), params.cls)  # instantiate() freezes a copy


def test_check_types_names_a_value_of_another_kind_than_its_default():
  p = Params()
  p.define("steps", 10, "")
  p.define("rate", 0.5, "")
  p.define("on", True, "")
  p.define("name", "x", "")
  p.define("anything", None, "")
  child = Params()
  child.define("dim", 4, "")
  p.define("child", child, "")
  p.set(rate=3, anything="whatever").check_types()  # an int is a float; None takes all
  for key, value, message in [("steps", "10", "steps='10' is a str; this key takes an int"),
                              ("steps", True, "steps=True is a bool"),
                              ("on", 1, "on=1 is an int; this key takes a bool"),
                              ("name", 7, "name=7 is an int; this key takes a str"),
                              ("child.dim", 2.5, "child.dim=2.5 is a float")]:
    q = p.copy().set(**{key: value})
    with pytest.raises(ParamsError, match=re.escape(message)):
      q.check_types()
  p.copy().set(**{"steps": None}).check_types()  # None: not set
