"""Images in chat requests, from content part to prompt tokens (issue 19, part 1).

    collect_image_urls(messages, settings)         image_url parts, in order, under the limit
    MediaConnector.fetch_images(image_urls)        data: / http(s) / file:// -> DecodedImage
    create_image_processing(model_dir, tokenizer)  the model's HF image processor + layout
    ImageProcessing.process(image, param)          -> ProcessedImage (pixels, grid, tokens)
    expand_placeholders(token_ids, ...)            one placeholder per image -> its tokens,
                                                   and each image's PlaceholderRange

Everything wrong with an image raises MediaError(message, param): HTTP 400 at the gateway.
"""

from services.tokenizer.multimodal.errors import MediaError
from services.tokenizer.multimodal.image_decoder import DecodedImage, decode_image
from services.tokenizer.multimodal.image_processing import ImageProcessing, ProcessedImage
from services.tokenizer.multimodal.image_url import ImageUrl, collect_image_urls
from services.tokenizer.multimodal.media_connector import MediaConnector
from services.tokenizer.multimodal.media_settings import MediaSettings
from services.tokenizer.multimodal.placeholders import PlaceholderRange, expand_placeholders
from services.tokenizer.multimodal.registry import create_image_processing

__all__ = [
    "DecodedImage", "ImageProcessing", "ImageUrl", "MediaConnector", "MediaError",
    "MediaSettings", "PlaceholderRange", "ProcessedImage", "collect_image_urls",
    "create_image_processing", "decode_image", "expand_placeholders",
]
