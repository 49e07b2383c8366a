"""Built-in convolutional networks: AlexNet, VGG-16, ResNet and an Inception-like CNN."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch
from torch import nn

from explorer.models.common import (
    Built,
    check_px,
    classification_loss,
    conv_out_px,
    image_classification,
    random_images,
    random_labels,
    scaled,
)


# -- AlexNet ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class AlexNetConfig:
    width: float
    resolution_px: int
    stem_kernel: int
    stem_stride: int
    stem_padding: int
    hidden_features: int
    n_classes: int
    batch_size: int
    dropout_p: float = 0.0


#: output channels of AlexNet's five convolutions at width 1
_ALEXNET_CHANNELS = (64, 192, 384, 256, 256)


class AlexNet(nn.Module):
    """Five convolutions with ReLU, three max-pools, three fully connected layers."""

    def __init__(self, cfg: AlexNetConfig) -> None:
        super().__init__()
        c1, c2, c3, c4, c5 = (scaled(c, cfg.width) for c in _ALEXNET_CHANNELS)
        self.features = nn.Sequential(
            nn.Conv2d(3, c1, cfg.stem_kernel, cfg.stem_stride, cfg.stem_padding),
            nn.ReLU(),
            nn.MaxPool2d(kernel_size=3, stride=2),
            nn.Conv2d(c1, c2, kernel_size=5, padding=2),
            nn.ReLU(),
            nn.MaxPool2d(kernel_size=3, stride=2),
            nn.Conv2d(c2, c3, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.Conv2d(c3, c4, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.Conv2d(c4, c5, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(kernel_size=3, stride=2),
        )
        px = conv_out_px(cfg.resolution_px, cfg.stem_kernel, cfg.stem_stride, cfg.stem_padding)
        for _ in range(3):
            px = conv_out_px(px, kernel=3, stride=2)
        check_px("alexnet", px)
        self.classifier = nn.Sequential(
            nn.Dropout(cfg.dropout_p),
            nn.Linear(c5 * px * px, cfg.hidden_features),
            nn.ReLU(),
            nn.Dropout(cfg.dropout_p),
            nn.Linear(cfg.hidden_features, cfg.hidden_features),
            nn.ReLU(),
            nn.Linear(cfg.hidden_features, cfg.n_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, 3, H, W)
        x = self.features(x)  # (B, C, h, w)
        x = torch.flatten(x, 1)  # (B, C*h*w)
        return self.classifier(x)  # (B, n_classes)


ALEXNET_SIZES = {
    "tiny": AlexNetConfig(width=1 / 8, resolution_px=32, stem_kernel=5, stem_stride=2,
                          stem_padding=2, hidden_features=64, n_classes=10, batch_size=8),
    "small": AlexNetConfig(width=1 / 4, resolution_px=64, stem_kernel=5, stem_stride=2,
                           stem_padding=2, hidden_features=256, n_classes=10, batch_size=16),
    "default": AlexNetConfig(width=1 / 2, resolution_px=128, stem_kernel=11, stem_stride=4,
                             stem_padding=2, hidden_features=1024, n_classes=100,
                             batch_size=16),
    "large": AlexNetConfig(width=1.0, resolution_px=224, stem_kernel=11, stem_stride=4,
                           stem_padding=2, hidden_features=4096, n_classes=1000,
                           batch_size=64),
}


def build_alexnet(cfg: AlexNetConfig, batch_size: int, gen: torch.Generator) -> Built:
    return image_classification(
        AlexNet(cfg), cfg.resolution_px, cfg.n_classes, batch_size, gen,
        (f"AlexNet-shaped CNN: 5 conv, 3 max-pool, 3 FC; width x{cfg.width:g}, "
         f"{cfg.resolution_px}px images, {cfg.n_classes} classes"))


# -- VGG-16 ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class VGGConfig:
    width: float
    resolution_px: int
    hidden_features: int
    n_classes: int
    batch_size: int
    dropout_p: float = 0.0


#: VGG-16: (output channels at width 1, number of 3x3 convolutions) of each of the 5 blocks
_VGG16_BLOCKS = ((64, 2), (128, 2), (256, 3), (512, 3), (512, 3))


class VGG16(nn.Module):
    """13 3x3 convolutions in 5 blocks, each block ending in a 2x2 max-pool; 3 FC layers."""

    def __init__(self, cfg: VGGConfig) -> None:
        super().__init__()
        blocks: OrderedDict[str, nn.Module] = OrderedDict()
        in_ch = 3
        for b, (channels, n_convs) in enumerate(_VGG16_BLOCKS, start=1):
            out_ch = scaled(channels, cfg.width)
            layers: OrderedDict[str, nn.Module] = OrderedDict()
            for c in range(1, n_convs + 1):
                layers[f"conv{c}"] = nn.Conv2d(in_ch, out_ch, kernel_size=3, padding=1)
                layers[f"relu{c}"] = nn.ReLU()
                in_ch = out_ch
            layers["pool"] = nn.MaxPool2d(kernel_size=2, stride=2)
            blocks[f"block{b}"] = nn.Sequential(layers)
        self.features = nn.Sequential(blocks)
        px = cfg.resolution_px // 2 ** len(_VGG16_BLOCKS)
        check_px("vgg16", px)
        self.classifier = nn.Sequential(
            nn.Linear(in_ch * px * px, cfg.hidden_features),
            nn.ReLU(),
            nn.Dropout(cfg.dropout_p),
            nn.Linear(cfg.hidden_features, cfg.hidden_features),
            nn.ReLU(),
            nn.Dropout(cfg.dropout_p),
            nn.Linear(cfg.hidden_features, cfg.n_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, 3, H, W)
        x = self.features(x)  # (B, C, H/32, W/32)
        x = torch.flatten(x, 1)  # (B, C*H*W/1024)
        return self.classifier(x)  # (B, n_classes)


VGG_SIZES = {
    "tiny": VGGConfig(width=1 / 16, resolution_px=32, hidden_features=64, n_classes=10,
                      batch_size=8),
    "small": VGGConfig(width=1 / 8, resolution_px=32, hidden_features=128, n_classes=10,
                       batch_size=16),
    "default": VGGConfig(width=1 / 4, resolution_px=64, hidden_features=512, n_classes=100,
                         batch_size=8),
    "large": VGGConfig(width=1.0, resolution_px=224, hidden_features=4096, n_classes=1000,
                       batch_size=32),
}


def build_vgg16(cfg: VGGConfig, batch_size: int, gen: torch.Generator) -> Built:
    return image_classification(
        VGG16(cfg), cfg.resolution_px, cfg.n_classes, batch_size, gen,
        (f"VGG-16-shaped CNN: 13 conv in 5 blocks, 3 FC; width x{cfg.width:g}, "
         f"{cfg.resolution_px}px images, {cfg.n_classes} classes"))


# -- ResNet ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class ResNetConfig:
    widths: tuple[int, ...]
    blocks_per_stage: tuple[int, ...]
    resolution_px: int
    n_classes: int
    batch_size: int
    #: "cifar": one 3x3 stride-1 convolution; "imagenet": 7x7 stride-2 convolution + max-pool
    stem: str = "cifar"


class BasicBlock(nn.Module):
    """Two 3x3 conv+BatchNorm layers with a residual add; a 1x1 conv shortcut when reshaping."""

    def __init__(self, in_ch: int, out_ch: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_ch, out_ch, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_ch)
        self.relu1 = nn.ReLU()
        self.conv2 = nn.Conv2d(out_ch, out_ch, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_ch)
        self.downsample: nn.Module | None = None
        if stride != 1 or in_ch != out_ch:
            self.downsample = nn.Sequential(
                nn.Conv2d(in_ch, out_ch, 1, stride=stride, bias=False),
                nn.BatchNorm2d(out_ch),
            )
        self.relu2 = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, C_in, H, W)
        out = self.relu1(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))  # (B, C_out, H/stride, W/stride)
        identity = x if self.downsample is None else self.downsample(x)
        return self.relu2(out + identity)


class ResNet(nn.Module):
    """Stem, stages of BasicBlocks (``layer1``, ``layer2``, ...), global average pool, FC."""

    def __init__(self, cfg: ResNetConfig) -> None:
        super().__init__()
        if len(cfg.widths) != len(cfg.blocks_per_stage):
            raise ValueError("resnet: widths and blocks_per_stage differ in length")
        stem_ch = cfg.widths[0]
        if cfg.stem == "imagenet":
            self.stem = nn.Sequential(
                nn.Conv2d(3, stem_ch, 7, stride=2, padding=3, bias=False),
                nn.BatchNorm2d(stem_ch),
                nn.ReLU(),
                nn.MaxPool2d(kernel_size=3, stride=2, padding=1),
            )
        else:
            self.stem = nn.Sequential(
                nn.Conv2d(3, stem_ch, 3, padding=1, bias=False),
                nn.BatchNorm2d(stem_ch),
                nn.ReLU(),
            )
        in_ch = stem_ch
        stages = zip(cfg.widths, cfg.blocks_per_stage, strict=True)
        for s, (width, n_blocks) in enumerate(stages, start=1):
            blocks = []
            for b in range(n_blocks):
                stride = 2 if (s > 1 and b == 0) else 1
                blocks.append(BasicBlock(in_ch, width, stride))
                in_ch = width
            self.add_module(f"layer{s}", nn.Sequential(*blocks))
        self.n_stages = len(cfg.widths)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(in_ch, cfg.n_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, 3, H, W)
        x = self.stem(x)
        for s in range(1, self.n_stages + 1):
            x = getattr(self, f"layer{s}")(x)  # (B, C_s, H_s, W_s)
        x = self.avgpool(x)  # (B, C, 1, 1)
        x = torch.flatten(x, 1)  # (B, C)
        return self.fc(x)  # (B, n_classes)


RESNET_SIZES = {
    "tiny": ResNetConfig(widths=(8, 16), blocks_per_stage=(1, 1), resolution_px=16,
                         n_classes=10, batch_size=8),
    "small": ResNetConfig(widths=(16, 32, 64), blocks_per_stage=(1, 1, 1), resolution_px=32,
                          n_classes=10, batch_size=16),
    "default": ResNetConfig(widths=(16, 32, 64, 128), blocks_per_stage=(2, 2, 2, 2),
                            resolution_px=32, n_classes=100, batch_size=16),
    "large": ResNetConfig(widths=(64, 128, 256, 512), blocks_per_stage=(2, 2, 2, 2),
                          resolution_px=224, n_classes=1000, batch_size=64, stem="imagenet"),
}


def build_resnet(cfg: ResNetConfig, batch_size: int, gen: torch.Generator) -> Built:
    module = ResNet(cfg)
    x = random_images(gen, batch_size, cfg.resolution_px)
    y = random_labels(gen, batch_size, cfg.n_classes)
    n_layers = 2 * sum(cfg.blocks_per_stage) + 2
    desc = (f"ResNet-{n_layers} with BasicBlocks and BatchNorm: widths "
            f"{'/'.join(map(str, cfg.widths))}, blocks {'/'.join(map(str, cfg.blocks_per_stage))}"
            f", {cfg.resolution_px}px images, {cfg.n_classes} classes")
    return module, (x,), (y,), classification_loss, desc


# -- Inception -------------------------------------------------------------------------------
@dataclass(frozen=True)
class InceptionConfig:
    width: float
    n_modules: int
    resolution_px: int
    stem_kernel: int
    stem_stride: int
    n_classes: int
    batch_size: int


#: GoogLeNet's inception modules at width 1: (name, 1x1, 3x3 reduce, 3x3, 5x5 reduce, 5x5,
#: pool projection); a stride-2 max-pool follows "3b" and "4e" when more modules come after
_GOOGLENET_MODULES = (
    ("3a", 64, 96, 128, 16, 32, 32),
    ("3b", 128, 128, 192, 32, 96, 64),
    ("4a", 192, 96, 208, 16, 48, 64),
    ("4b", 160, 112, 224, 24, 64, 64),
    ("4c", 128, 128, 256, 24, 64, 64),
    ("4d", 112, 144, 288, 32, 64, 64),
    ("4e", 256, 160, 320, 32, 128, 128),
    ("5a", 256, 160, 320, 32, 128, 128),
    ("5b", 384, 192, 384, 48, 128, 128),
)
_POOL_AFTER = ("3b", "4e")


def _conv_relu(in_ch: int, out_ch: int, kernel: int, stride: int = 1) -> list[nn.Module]:
    return [nn.Conv2d(in_ch, out_ch, kernel, stride=stride, padding=kernel // 2), nn.ReLU()]


class InceptionModule(nn.Module):
    """Four parallel branches concatenated on channels: 1x1; 1x1->3x3; 1x1->5x5; pool->1x1."""

    def __init__(self, in_ch: int, c1: int, c3_reduce: int, c3: int, c5_reduce: int, c5: int,
                 pool_proj: int) -> None:
        super().__init__()
        self.branch1 = nn.Sequential(*_conv_relu(in_ch, c1, 1))
        self.branch2 = nn.Sequential(*_conv_relu(in_ch, c3_reduce, 1),
                                     *_conv_relu(c3_reduce, c3, 3))
        self.branch3 = nn.Sequential(*_conv_relu(in_ch, c5_reduce, 1),
                                     *_conv_relu(c5_reduce, c5, 5))
        self.branch4 = nn.Sequential(nn.MaxPool2d(kernel_size=3, stride=1, padding=1),
                                     *_conv_relu(in_ch, pool_proj, 1))
        self.out_channels = c1 + c3 + c5 + pool_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, C_in, H, W)
        branches = [self.branch1(x), self.branch2(x), self.branch3(x), self.branch4(x)]
        return torch.cat(branches, dim=1)  # (B, c1 + c3 + c5 + pool_proj, H, W)


class Inception(nn.Module):
    """GoogLeNet-like: stem, inception modules with max-pools between groups, avg pool, FC."""

    def __init__(self, cfg: InceptionConfig) -> None:
        super().__init__()
        if not 1 <= cfg.n_modules <= len(_GOOGLENET_MODULES):
            raise ValueError(f"inception: n_modules must be 1..{len(_GOOGLENET_MODULES)}")
        c_a, c_b, c_c = (scaled(c, cfg.width) for c in (64, 64, 192))
        self.stem = nn.Sequential(
            *_conv_relu(3, c_a, cfg.stem_kernel, cfg.stem_stride),
            nn.MaxPool2d(kernel_size=3, stride=2, padding=1),
            *_conv_relu(c_a, c_b, 1),
            *_conv_relu(c_b, c_c, 3),
            nn.MaxPool2d(kernel_size=3, stride=2, padding=1),
        )
        px = conv_out_px(cfg.resolution_px, cfg.stem_kernel, cfg.stem_stride,
                          cfg.stem_kernel // 2)
        px = conv_out_px(conv_out_px(px, 3, 2, 1), 3, 2, 1)
        check_px("inception", px)
        stages: OrderedDict[str, nn.Module] = OrderedDict()
        in_ch = c_c
        chosen = _GOOGLENET_MODULES[:cfg.n_modules]
        for i, (label, *channels) in enumerate(chosen):
            module = InceptionModule(in_ch, *(scaled(c, cfg.width, minimum=2) for c in channels))
            stages[f"inception{label}"] = module
            in_ch = module.out_channels
            if label in _POOL_AFTER and i + 1 < len(chosen):
                stages[f"pool{label[0]}"] = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.blocks = nn.Sequential(stages)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(in_ch, cfg.n_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, 3, H, W)
        x = self.stem(x)  # (B, C, H/4, W/4) or smaller with a strided stem convolution
        x = self.blocks(x)  # (B, C', h, w)
        x = self.avgpool(x)  # (B, C', 1, 1)
        x = torch.flatten(x, 1)  # (B, C')
        return self.fc(x)  # (B, n_classes)


INCEPTION_SIZES = {
    "tiny": InceptionConfig(width=1 / 16, n_modules=2, resolution_px=16, stem_kernel=3,
                            stem_stride=1, n_classes=10, batch_size=8),
    "small": InceptionConfig(width=1 / 8, n_modules=3, resolution_px=32, stem_kernel=3,
                             stem_stride=1, n_classes=10, batch_size=16),
    "default": InceptionConfig(width=1 / 4, n_modules=5, resolution_px=64, stem_kernel=3,
                               stem_stride=1, n_classes=100, batch_size=16),
    "large": InceptionConfig(width=1.0, n_modules=9, resolution_px=224, stem_kernel=7,
                             stem_stride=2, n_classes=1000, batch_size=32),
}


def build_inception(cfg: InceptionConfig, batch_size: int, gen: torch.Generator) -> Built:
    return image_classification(
        Inception(cfg), cfg.resolution_px, cfg.n_classes, batch_size, gen,
        (f"Inception-like CNN: {cfg.n_modules} four-branch modules; width x{cfg.width:g}, "
         f"{cfg.resolution_px}px images, {cfg.n_classes} classes"))


