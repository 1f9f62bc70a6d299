"""One `keras.applications` model per family, at the smallest input it
accepts.

A family is a module of `keras.applications` (VGG19 shares VGG16's
family); its row is its smallest model, built with `weights=None` (nothing
downloads), `include_top=False`, `pooling="avg"` (the compared output is
the pooled features), at the smallest square input the model accepts
(`imagenet_utils.obtain_input_shape`'s `min_size`: 32 for most, 71 for
Xception, 75 for the Inception models), fed random pixels through the
family's `preprocess_input`.
"""

from zoo.spec import ZooModel
from zoo.spec import image

SOURCE = "keras.applications"

# (function, family module, smallest input)
FAMILIES = (
    ("ConvNeXtTiny", "convnext", 32),
    ("DenseNet121", "densenet", 32),
    ("EfficientNetB0", "efficientnet", 32),
    ("EfficientNetV2B0", "efficientnet_v2", 32),
    ("InceptionResNetV2", "inception_resnet_v2", 75),
    ("InceptionV3", "inception_v3", 75),
    ("MobileNet", "mobilenet", 32),
    ("MobileNetV2", "mobilenet_v2", 32),
    ("MobileNetV3Small", "mobilenet_v3", 32),
    ("NASNetMobile", "nasnet", 32),
    ("ResNet50", "resnet", 32),
    ("ResNet50V2", "resnet_v2", 32),
    ("VGG16", "vgg16", 32),
    ("Xception", "xception", 71),
)

APPLICATIONS = {}


def _register(fn_name, family, size, fast=False):
    def build():
        import keras

        fn = getattr(keras.applications, fn_name)
        return fn(weights=None, include_top=False, pooling="avg",
                  input_shape=(size, size, 3))

    APPLICATIONS[fn_name] = ZooModel(
        name=fn_name, source=SOURCE, build=build,
        inputs=image(size, family),
        config=f"keras.applications.{fn_name}(weights=None, "
               f"include_top=False, pooling='avg', "
               f"input_shape=({size}, {size}, 3))",
        note=f"family {family}", fast=fast)


for _fn, _family, _size in FAMILIES:
    _register(_fn, _family, _size, fast=_fn == "VGG16")


def family_names():
    """The `keras.applications` modules that hold models (one per family);
    `vgg19` is VGG16's family."""
    import keras

    return sorted(
        name for name in dir(keras.applications)
        if not name.startswith("_") and name[0].islower()
        and name not in ("imagenet_utils", "vgg19", "resnet50"))
